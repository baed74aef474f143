"""The scheduler's image rules (vision-language engines): an image's tokens are never split
across steps, each image is encoded once while its output stays cached (within the encoder
budget per step and the cache's rows), and block hashes carry the image's identifier."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.core.encoder_cache_manager import EncoderCacheManager
from jaxinfer.multimodal.inputs import MultiModalFeature
from tests.core.fake import FakeRunner, make_request, make_scheduler, run_to_completion

IMG = 99


def _feature(ident, offset, length):
    return MultiModalFeature(identifier=ident, offset=offset, length=length,
                             grid_thw=(1, 2, 2 * length), pixel_values=b"", patch_dim=1)


def _request(rid, layout, images=None, **kw):
    """layout: ints = text tokens, ("img", id, n) = an image of n tokens."""
    ids, feats = [], []
    for part in layout:
        if isinstance(part, tuple):
            _, ident, n = part
            feats.append(_feature(ident, len(ids), n))
            ids += [IMG] * n
        else:
            ids.append(part)
    r = make_request(rid, ids, **kw)
    r.mm_features = feats
    return r


def _scheduler(cache_rows=0, **cfg):
    s = make_scheduler(**cfg)
    s.enable_encoder_cache(cache_rows)
    return s


class Recorder(FakeRunner):
    """Records each step's chunks and encoder inputs; checks that an image's tokens are all
    in one chunk and that its output was encoded (or cached) by then."""

    def __init__(self, sched):
        super().__init__()
        self.sched, self.chunks, self.encoded, self.live = sched, [], [], set()

    def execute(self, so):
        self.live -= set(so.free_encoder_mm_hashes)
        for rid, which in so.scheduled_encoder_inputs.items():
            for k in which:
                ident = self.sched.requests[rid].mm_features[k].identifier
                assert ident not in self.live  # (never encoded twice while cached)
                self.live.add(ident)
                self.encoded.append(ident)
        for new in so.scheduled_new_reqs:
            self.computed[new.req_id] = new.num_computed_tokens
        for rid, n in so.num_scheduled_tokens.items():
            c = self.computed.get(rid, 0)
            for f in self.sched.requests[rid].mm_features:
                if f.offset < c + n and f.end > c:
                    assert f.end <= c + n, (rid, c, n, f.offset, f.end)  # never split
                    assert f.identifier in self.live
            self.chunks.append((rid, c, n))
        return super().execute(so)


def test_chunks_end_before_an_image_never_inside():
    s = _scheduler(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64,
                   enable_chunked_prefill=True)
    r = _request("a", [1, 2, 3, 4, 5, ("img", "x", 6), 6, 7, ("img", "y", 8), 8], max_tokens=2)
    s.add_request(r)
    rec = Recorder(s)
    run_to_completion(s, rec)
    # 5 text tokens, then the 6-token image alone (5 + 6 > 8), then 2 text + ... never split
    assert [n for _, _, n in rec.chunks][:3] == [5, 8, 8]
    assert rec.encoded == ["x", "y"]


def test_an_image_larger_than_the_step_is_refused():
    s = _scheduler(max_num_batched_tokens=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.add_request(_request("a", [1, ("img", "x", 9)]))
    t = make_scheduler(max_num_batched_tokens=8, max_model_len=64)  # a text-only engine
    with pytest.raises(ValueError, match="text only"):
        t.add_request(_request("a", [1, ("img", "x", 4)]))


def test_same_image_encoded_once_and_budget_per_step():
    """Two requests with image x in one step: one encoder run. A third request whose chunk
    would end inside its image takes only its text before the image."""
    s = _scheduler(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    for rid in "ab":
        s.add_request(_request(rid, [1, ("img", "x", 6), 2], max_tokens=1))
    s.add_request(_request("c", [3, ("img", "z", 6), 4], max_tokens=1))
    rec = Recorder(s)
    so = s.schedule()
    # a: 8 tokens (x encoded); b: a prefix hit on a's first block, then the rest of x
    # (no second run); c: the 4 tokens left would end inside z: only its text before z
    assert so.scheduled_encoder_inputs == {"a": (0,)}
    assert so.num_scheduled_tokens == {"a": 8, "b": 4, "c": 1}
    s.update_from_output(so, rec.execute(so))
    run_to_completion(s, rec)
    assert rec.encoded == ["x", "z"]
    assert s.encoder_cache.num_hits >= 1


def test_cache_evicts_least_recent_and_keeps_pinned():
    c = EncoderCacheManager(10)
    c.allocate("a", 4)
    c.allocate("b", 4)
    assert c.end_step() == ()
    c.use("a")  # pinned this step, most recent
    assert not c.can_allocate(8, 0) and c.can_allocate(6, 0)
    c.allocate("c", 6)  # evicts b, not a
    assert "a" in c and "b" not in c and c.end_step() == ("b",)
    c.allocate("d", 10)
    assert c.end_step() == ("a", "c") and c.used == 10


def test_same_text_other_image_shares_no_block_past_it():
    """Block hashes carry the identifiers of the images in the block: the blocks before the
    image are shared, the ones holding it (and every later one) are not."""
    s = _scheduler(max_num_batched_tokens=32, max_model_len=64, block_size=4)
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    s.add_request(_request("a", text + [("img", "x", 4)] + [9, 10, 11, 12], max_tokens=1))
    rec = Recorder(s)
    run_to_completion(s, rec)
    same = _request("b", text + [("img", "x", 4)] + [9, 10, 11, 12], max_tokens=1)
    other = _request("c", text + [("img", "y", 4)] + [9, 10, 11, 12], max_tokens=1)
    s.add_request(same)
    s.add_request(other)
    run_to_completion(s, rec)
    assert same.num_cached_tokens == 12  # (all full blocks but the last: it samples)
    assert other.num_cached_tokens == 8
    assert np.unique(same.block_hashes[:3]).size == 3
