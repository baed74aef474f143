"""vLLM 0.32 scheduler semantics, one concrete vector each (block_size 4 throughout).

Found by driving vLLM 0.32.0's own Scheduler and ours on the same traces."""

from __future__ import annotations

from jaxinfer.request import FinishReason
from tests.core.fake import EOS, FakeRunner, make_request, make_scheduler, run_to_completion


def test_admission_needs_blocks_for_the_whole_sequence():
    """10 usable blocks. a (24 tokens = 6 blocks) is admitted with an 8-token chunk (2 blocks);
    b (36 tokens = 9 blocks) would fit its first chunk in the 8 free blocks, but not its whole
    prompt, so it waits (vLLM's scheduler_reserve_full_isl, on by default)."""
    def first_step(reserve):
        s = make_scheduler(num_blocks=11, max_model_len=40, max_num_batched_tokens=16,
                           long_prefill_token_threshold=8, scheduler_reserve_full_isl=reserve)
        s.add_request(make_request("a", range(100, 124), max_tokens=2))
        s.add_request(make_request("b", range(200, 236), max_tokens=2))
        return s, s.schedule()

    s, so = first_step(True)
    assert so.num_scheduled_tokens == {"a": 8}
    assert s.kv.get_num_free_blocks() == 8
    _, so_old = first_step(False)
    assert so_old.num_scheduled_tokens == {"a": 8, "b": 8}  # the chunk-only check admits b
    # Everything still completes, with fewer preemptions than the chunk-only check.
    preemptions = {}
    for reserve in (True, False):
        s2 = make_scheduler(num_blocks=11, max_model_len=40, max_num_batched_tokens=16,
                            long_prefill_token_threshold=8, scheduler_reserve_full_isl=reserve)
        s2.add_request(make_request("a", range(100, 124), max_tokens=8))
        s2.add_request(make_request("b", range(200, 236), max_tokens=3))
        outs = run_to_completion(s2, FakeRunner())
        assert sum(len(o.new_token_ids) for o in outs["a"]) == 8
        assert sum(len(o.new_token_ids) for o in outs["b"]) == 3
        preemptions[reserve] = s2.num_preemptions
        assert s2.kv.get_num_free_blocks() == 10
    assert preemptions[True] == 0 < preemptions[False]


def test_long_prefill_threshold_ignored_for_a_lone_request():
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    s.add_request(make_request("a", range(100, 130), max_tokens=2))
    assert s.schedule().num_scheduled_tokens == {"a": 30}
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    s.add_request(make_request("a", range(100, 130), max_tokens=2))
    s.add_request(make_request("b", range(300, 330), max_tokens=2))
    assert s.schedule().num_scheduled_tokens == {"a": 8, "b": 8}


def test_freed_unhashed_blocks_are_reused_first_hashed_ones_last():
    """10 prompt tokens + 1 output: blocks [full, full, partial]. On finish, the partial block
    (no hash, can never be hit) goes to the FRONT of the free queue; the hashed ones to the
    tail, tail block first (the prefix's first block is evicted last)."""
    s = make_scheduler(num_blocks=17)
    s.add_request(make_request("a", range(100, 110), max_tokens=1))
    so = s.schedule()
    b1, b2, b3 = so.scheduled_new_reqs[0].block_ids
    s.update_from_output(so, FakeRunner().execute(so))
    q = s.kv.block_pool.free_block_queue.block_ids()
    assert q[0] == b3
    assert q[-2:] == [b2, b1]
    # Without prefix caching nothing is hashed: all three go to the front, tail first.
    s = make_scheduler(num_blocks=17, caching=False)
    s.add_request(make_request("a", range(100, 110), max_tokens=1))
    so = s.schedule()
    ids = so.scheduled_new_reqs[0].block_ids
    s.update_from_output(so, FakeRunner().execute(so))
    assert s.kv.block_pool.free_block_queue.block_ids()[:3] == list(reversed(ids))


def test_eos_or_stop_id_on_the_last_allowed_token_finishes_with_stop():
    def finish(next_tok, **params):
        s = make_scheduler()
        s.add_request(make_request("a", range(100, 105), **params))
        outs = run_to_completion(s, FakeRunner(lambda rid, n: next_tok))
        return outs["a"][-1]

    o = finish(EOS, max_tokens=1)
    assert (o.finish_reason, o.stop_reason) == (FinishReason.STOP, None)
    o = finish(77, max_tokens=1, stop_token_ids=[77])
    assert (o.finish_reason, o.stop_reason) == (FinishReason.STOP, 77)
    o = finish(EOS, max_tokens=1, ignore_eos=True)
    assert o.finish_reason == FinishReason.LENGTH
    # Below min_tokens EOS is not a stop: the second EOS (at min_tokens=2) is.
    s = make_scheduler()
    s.add_request(make_request("a", range(100, 105), max_tokens=3, min_tokens=2))
    outs = run_to_completion(s, FakeRunner(lambda rid, n: EOS))["a"]
    assert [t for o in outs for t in o.new_token_ids] == [EOS, EOS]
    assert outs[-1].finish_reason == FinishReason.STOP
