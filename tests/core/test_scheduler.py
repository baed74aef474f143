"""Scheduler behaviour, vector by vector (block_size 4 throughout)."""

from __future__ import annotations

import pytest

from jaxinfer.request import FinishReason, RequestStatus
from tests.core.fake import EOS, FakeRunner, make_request, make_scheduler, run_to_completion


def _step(sched, runner):
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


def test_chunk_sizes_under_budget_and_threshold():
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=12,
                       max_model_len=64)
    for k, (rid, n) in enumerate((("a", 30), ("b", 20), ("c", 10))):
        s.add_request(make_request(rid, range(1000 * k, 1000 * k + n), max_tokens=2))
    r = FakeRunner()
    chunks = []
    while s.has_unfinished_requests():
        so, _ = _step(s, r)
        chunks.append(dict(so.num_scheduled_tokens))
    assert chunks == [
        {"a": 12, "b": 12, "c": 8},
        {"a": 12, "b": 8, "c": 2},  # b and c finish their prefill and sample
        {"a": 6, "b": 1, "c": 1},  # a finishes prefill; b and c decode their 2nd token
        {"a": 1},
    ]


def test_shared_prompt_prefix_is_hit_within_the_same_step():
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=12)
    for rid, n in (("a", 30), ("b", 20), ("c", 10)):
        s.add_request(make_request(rid, range(100, 100 + n), max_tokens=2))
    so = s.schedule()
    # a fills 3 blocks this step; b hits them (12 tokens), c hits 2 blocks (leaves 1 token).
    assert so.num_scheduled_tokens == {"a": 12, "b": 8, "c": 2}
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs] == [0, 12, 8]


def test_strict_fcfs_without_chunking():
    s = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False,
                       max_model_len=64)
    s.add_request(make_request("small", range(10), max_tokens=3))
    s.add_request(make_request("long", range(100, 164), max_tokens=2))
    s.add_request(make_request("tiny", range(3), max_tokens=2))
    r = FakeRunner()
    steps = []
    while s.has_unfinished_requests():
        so, _ = _step(s, r)
        steps.append(dict(so.num_scheduled_tokens))
    # long (64) never fits beside small, and tiny is never let past it; no chunk is cut.
    assert steps == [{"small": 10}, {"small": 1}, {"small": 1}, {"long": 64}, {"tiny": 3},
                     {"tiny": 1}]


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(i, range(5), max_tokens=3))
    so, _ = _step(s, FakeRunner())
    assert set(so.num_scheduled_tokens) == {"0", "1"} and len(s.waiting) == 2


def test_fcfs_preempts_latest_running_and_resumes_it_first():
    # 6 usable blocks of 4 tokens. a and b each take 2 blocks for 7-token prompts, then grow.
    s = make_scheduler(num_blocks=7, max_model_len=24, max_num_batched_tokens=64)
    s.add_request(make_request("a", range(7), max_tokens=12, arrival=0))
    s.add_request(make_request("b", range(10, 17), max_tokens=12, arrival=1))
    s.add_request(make_request("c", range(20, 27), max_tokens=12, arrival=2))
    r = FakeRunner()
    seen_preempt = []
    while s.has_unfinished_requests():
        so, _ = _step(s, r)
        if so.preempted_req_ids:
            seen_preempt.append((sorted(so.preempted_req_ids), sorted(so.num_scheduled_tokens)))
            assert not so.scheduled_new_reqs  # no admissions in a step that preempted
    assert seen_preempt[0] == (["c"], ["a", "b"])
    assert s.kv.get_num_free_blocks() == 6


def test_preempted_request_goes_to_front_and_recomputes():
    s = make_scheduler(num_blocks=5, max_model_len=16, max_num_batched_tokens=64)
    a = make_request("a", range(7), max_tokens=9, arrival=0)
    b = make_request("b", range(10, 17), max_tokens=9, arrival=1)
    s.add_request(a)
    s.add_request(b)
    s.add_request(make_request("z", range(30, 33), max_tokens=1, arrival=2))
    r = FakeRunner()
    so, _ = _step(s, r)  # a, b prefill (2 blocks each); z finds no free block and waits
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    so, _ = _step(s, r)  # a, b decode (position 7): still in block 2
    so, _ = _step(s, r)  # position 8: both need a third block, only 0 free -> preempt b
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting.peek() is b  # in front of z
    outs = run_to_completion(s, r)
    assert b.num_preemptions >= 1 and len(b.output_token_ids) == 9
    assert outs["b"][-1].finish_reason == "length" and outs["z"][-1].finished
    # The fake runner's token depends only on the sequence length, so recompute is invisible.
    assert b.output_token_ids == [1000 + n for n in range(7, 16)]
    assert s.kv.get_num_free_blocks() == 4 and not s.requests


def test_priority_preempts_lowest_priority_and_admits_by_priority():
    s = make_scheduler(num_blocks=5, max_model_len=16, max_num_batched_tokens=64,
                       policy="priority")
    s.add_request(make_request("low", range(7), max_tokens=9, priority=5, arrival=0))
    s.add_request(make_request("high", range(10, 17), max_tokens=9, priority=0, arrival=1))
    r = FakeRunner()
    so, _ = _step(s, r)
    assert list(so.num_scheduled_tokens) == ["high", "low"]  # admitted by priority
    _step(s, r)
    so, _ = _step(s, r)
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 1}
    # Under priority the victim can sit before the request that needs room; undo its slot.
    s2 = make_scheduler(num_blocks=5, max_model_len=16, max_num_batched_tokens=64,
                        policy="priority")
    s2.add_request(make_request("first", range(5), max_tokens=9, priority=9, arrival=0))
    _step(s2, r2 := FakeRunner())
    s2.add_request(make_request("second", range(10, 17), max_tokens=9, priority=1, arrival=1))
    _step(s2, r2)  # first decodes position 5, second prefills 7 tokens: 4 blocks in use
    _step(s2, r2)  # positions 6 and 7
    so, _ = _step(s2, r2)  # first (pos 7) is scheduled, then second (pos 8) needs a block
    assert so.preempted_req_ids == {"first"} and so.num_scheduled_tokens == {"second": 1}
    assert so.total_num_scheduled_tokens == 1
    run_to_completion(s2, r2)
    assert s2.kv.get_num_free_blocks() == 4


@pytest.mark.parametrize("case", ["eos", "ignore_eos", "stop_token", "max_tokens", "min_tokens",
                                  "max_model_len"])
def test_stop_conditions(case):
    s = make_scheduler(max_model_len=20)
    tokens = iter([5, 6, EOS, 7, EOS, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    params = {"eos": {}, "ignore_eos": {"ignore_eos": True, "max_tokens": 4},
              "stop_token": {"stop_token_ids": [EOS + 100, 6]}, "max_tokens": {"max_tokens": 2},
              "min_tokens": {"min_tokens": 4}, "max_model_len": {"max_tokens": 100,
                                                                 "ignore_eos": True}}[case]
    req = make_request("r", range(10, 14), **params)
    s.add_request(req)
    outs = run_to_completion(s, FakeRunner(lambda rid, n: next(tokens)))
    final = outs["r"][-1]
    expected = {
        "eos": ([5, 6, EOS], FinishReason.STOP, None),
        "ignore_eos": ([5, 6, EOS, 7], FinishReason.LENGTH, None),
        "stop_token": ([5, 6], FinishReason.STOP, 6),
        "max_tokens": ([5, 6], FinishReason.LENGTH, None),
        "min_tokens": ([5, 6, EOS, 7, EOS], FinishReason.STOP, None),
        "max_model_len": ([5, 6, EOS, 7, EOS, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
                          FinishReason.LENGTH, None),
    }[case]
    assert (req.output_token_ids, final.finish_reason, final.stop_reason) == expected
    assert req.num_tokens <= 20 and s.kv.get_num_free_blocks() == 63 and not s.requests


def test_rejections_at_add_time():
    s = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="40 tokens.*max_model_len=32"):
        s.add_request(make_request("long", range(40)))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("empty", []))
    s.add_request(make_request("dup", range(3)))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("dup", range(3)))
    with pytest.raises(ValueError, match="holds 12 tokens.*max_model_len=32"):
        make_scheduler(num_blocks=4, max_model_len=32)
    assert s.get_num_unfinished_requests() == 1  # the bad ones left no trace


def test_abort_frees_blocks_everywhere():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", range(9)))
    s.add_request(make_request("wait", range(9)))
    r = FakeRunner()
    _step(s, r)
    s.abort(["run", "wait", "unknown"])
    assert not s.has_unfinished_requests() and s.kv.get_num_free_blocks() == 63
    so = s.schedule()
    assert so.finished_req_ids == {"run", "wait"} and so.is_empty


def test_abort_during_step_drops_its_output():
    s = make_scheduler()
    s.add_request(make_request("a", range(5)))
    r = FakeRunner()
    so = s.schedule()
    ro = r.execute(so)
    s.abort("a")
    assert s.update_from_output(so, ro) == []
    assert s.kv.get_num_free_blocks() == 63


def test_prefix_hit_on_admission_and_num_cached_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", range(13), max_tokens=1))
    r = FakeRunner()
    run_to_completion(s, r)
    b = make_request("b", [*range(12), 99], max_tokens=1)
    s.add_request(b)
    so, outs = _step(s, r)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens == {"b": 1} and outs[0].num_cached_tokens == 12
    assert s.make_stats()["prefix_cache_hits"] == 12


def test_same_step_prefix_sharing():
    """A request admitted after another in the same step hits the blocks that step fills."""
    s = make_scheduler()
    s.add_request(make_request("a", range(13), max_tokens=1))
    s.add_request(make_request("b", range(13), max_tokens=1))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 13, "b": 1}
    assert so.scheduled_new_reqs[1].block_ids[:3] == so.scheduled_new_reqs[0].block_ids[:3]


def test_children_of_a_large_n_request_do_not_hold_the_others_back():
    """The samples of an n > 1 request take at most half the seats while others wait; seats
    left over still go to them (a lone large-n request keeps the whole batch)."""
    def child(i, parent="big", arrival=0.0):
        r = make_request(f"{i}_{parent}", range(5), max_tokens=3, arrival=arrival)
        r.parent_id = parent
        return r

    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(8):
        s.add_request(child(i))
    s.add_request(make_request("late", range(50, 55), max_tokens=3, arrival=1.0))
    so = s.schedule()
    # Two children (half the seats), then the later request, then a third child (a free seat).
    assert list(so.num_scheduled_tokens) == ["0_big", "1_big", "late", "2_big"]
    assert [r.request_id for r in s.waiting][:2] == ["3_big", "4_big"]  # order kept
    r = FakeRunner()
    s.update_from_output(so, r.execute(so))
    run_to_completion(s, r)

    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(8):
        s.add_request(child(i))
    assert list(s.schedule().num_scheduled_tokens) == ["0_big", "1_big", "2_big", "3_big"]
