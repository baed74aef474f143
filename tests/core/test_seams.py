"""Seams for the features that plug into the scheduler (spec decode, structured outputs, KV
connectors), exercised with a fake drafter and a fake connector (block_size 4)."""

from __future__ import annotations

from jaxinfer.kv_connector.base import KVConnectorScheduler
from jaxinfer.outputs import RunnerOutput, SchedulerOutput
from jaxinfer.request import RequestStatus
from tests.core.fake import FakeRunner, make_request, make_scheduler, run_to_completion


def target(rid, n):
    """The 'model': the token at position n of request rid."""
    return 1000 + (n * 7) % 13


class VerifyingRunner:
    """Like FakeRunner, but verifies scheduled drafts greedily: returns the accepted prefix of
    the drafts plus the target's next token (a spec-decode step)."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(rid, ())
            toks = self.tokens[rid]
            self.computed[rid] += n - len(drafts)
            ids.append(rid)
            if self.computed[rid] < len(toks):
                sampled.append(())
                continue
            out = []
            for d in drafts:
                want = target(rid, len(toks) + len(out))
                if d != want:
                    break
                out.append(d)
            out.append(target(rid, len(toks) + len(out)))
            toks.extend(out)
            self.computed[rid] = len(toks) - 1
            sampled.append(tuple(out))
        return RunnerOutput(req_ids=tuple(ids), sampled_token_ids=tuple(sampled))


def test_drafts_are_scheduled_verified_and_rolled_back():
    """A fake drafter proposes 3 drafts per step, the first two right and the third wrong: each
    step accepts 2 + the bonus token, and the scheduler rolls back the rejected one. Output
    equals the plain run; drafts get slots but never enter the prefix cache; no block leaks."""
    plain = make_scheduler(num_blocks=40)
    plain.add_request(make_request("a", range(100, 110), max_tokens=12))
    want = [t for o in run_to_completion(plain, FakeRunner(target))["a"]
            for t in o.new_token_ids]

    s = make_scheduler(num_blocks=40)
    s.add_request(make_request("a", range(100, 110), max_tokens=12))
    runner = VerifyingRunner()
    got, spec_steps = [], 0
    while s.has_unfinished_requests():
        req = s.requests.get("a")
        if req is not None and req.num_output_tokens:
            n = req.num_tokens
            req.spec_token_ids = [target("a", n), target("a", n + 1), -1]  # 2 right, 1 wrong
        so = s.schedule()
        if so.scheduled_spec_decode_tokens:
            spec_steps += 1
            assert so.scheduled_spec_decode_tokens["a"] == tuple(req.spec_token_ids)
            assert so.num_scheduled_tokens["a"] == 4  # the last token + 3 drafts
            blocks = len(s.kv.req_to_blocks["a"])
            assert blocks * 4 >= req.num_tokens + 3  # slots for the drafts too
        for o in s.update_from_output(so, runner.execute(so)):
            got.extend(o.new_token_ids)
        if "a" in s.requests:
            r = s.requests["a"]
            assert r.num_computed_tokens == r.num_tokens - 1  # rolled back past the reject
            assert s.kv.num_cached_blocks.get("a", 0) <= r.num_tokens // 4
    assert got == want
    assert spec_steps == 4  # 12 tokens: 1 from the prefill, then 3 per step (4th step: 2)
    assert s.kv.get_num_free_blocks() == 39


def test_requests_waiting_for_fsm_or_remote_kv_are_skipped_in_place():
    s = make_scheduler(num_blocks=40)
    for rid in "abc":
        s.add_request(make_request(rid, range(100, 104), max_tokens=2))
    s.requests["a"].status = RequestStatus.WAITING_FOR_FSM
    s.requests["b"].status = RequestStatus.WAITING_FOR_REMOTE_KVS
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["c"]
    assert [r.request_id for r in s.waiting] == ["a", "b"]  # order kept
    s.update_from_output(so, FakeRunner().execute(so))
    s.set_request_ready("b")
    so2 = s.schedule()
    assert list(so2.num_scheduled_tokens) == ["c", "b"]
    assert [r.request_id for r in s.waiting] == ["a"]
    s.finish_requests(["a"])  # an abort of a blocked request frees cleanly
    assert not s.waiting


class FakeConnector(KVConnectorScheduler):
    def __init__(self):
        super().__init__(None, 4)
        self.finished = []

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, list(block_ids)))
        return True, {"remote_block_ids": list(block_ids), "remote_engine_id": "p0"}


def test_connector_may_delay_freeing_a_finished_requests_blocks():
    conn = FakeConnector()
    s = make_scheduler(num_blocks=40)
    s.kv_connector = conn
    s.add_request(make_request("a", range(100, 110), max_tokens=1))
    outs = run_to_completion(s, FakeRunner())
    (rid, blocks), = conn.finished
    assert outs["a"][-1].kv_transfer_params == {"remote_block_ids": blocks,
                                                "remote_engine_id": "p0"}
    assert len(blocks) == 3 and s.kv.get_num_free_blocks() == 39 - 3  # still held
    assert "a" not in s.requests and "a" in s.delayed_free
    s.finish_delayed_free(["a"])
    assert s.kv.get_num_free_blocks() == 39 and not s.delayed_free


def test_allocate_slots_external_tokens_lookahead_and_delayed_caching():
    s = make_scheduler(num_blocks=40)
    kv = s.kv
    r = make_request("a", range(100, 108), max_tokens=4)
    # An async KV load: 8 external tokens get slots, nothing computed locally, nothing cached.
    new = kv.allocate_slots(r, 0, num_external_computed_tokens=8, delay_cache_blocks=True)
    assert len(new) == 2 and kv.num_cached_blocks.get("a", 0) == 0
    kv.cache_blocks(r, 8)  # the KV arrived: publish the blocks
    assert kv.num_cached_blocks["a"] == 2
    r.num_computed_tokens = 8
    r.append_output_token_ids(5)
    # One new token plus 4 lookahead slots (drafts): 13 slots = 4 blocks, 2 of them new;
    # only full blocks of real tokens are cached (9 tokens: still 2).
    new = kv.allocate_slots(r, 1, num_lookahead_tokens=4)
    assert len(new) == 2 and kv.num_cached_blocks["a"] == 2
    kv.free(r)
    assert kv.get_num_free_blocks() == 39
