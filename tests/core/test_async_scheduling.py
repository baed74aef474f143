"""Async scheduling on the host: step N+1 is scheduled before step N's tokens are known.

The scheduler counts the token in flight (num_output_placeholders); the outputs must be what
synchronous stepping produces, whatever the preemptions, chunking and stops on the way."""

from __future__ import annotations

import random
from collections import deque

import pytest

from jaxinfer.request import RequestStatus
from tests.core.fake import FakeRunner, make_request, make_scheduler
from tests.core.test_random_driver import _token


def _drive(sched, runner, arrivals, *, pipelined: bool, abort_rng=None):
    """Run `arrivals` ({step: [requests]}) to completion; with pipelined=True each step's
    output reaches the scheduler only after the next step has been scheduled (and run)."""
    results: dict[str, tuple] = {}
    in_flight: deque = deque()
    step = 0
    while step <= max(arrivals) or sched.has_unfinished_requests() or in_flight:
        step += 1
        assert step < 20000, "requests stopped making progress"
        for req in arrivals.get(step, ()):
            sched.add_request(req)
        if abort_rng is not None and abort_rng.random() < 0.03 and sched.requests:
            sched.abort(abort_rng.choice(sorted(sched.requests)))
        dispatched = False
        if sched.has_unfinished_requests():
            so = sched.schedule()
            for r in sched.running:  # at most the one token in flight is scheduled ahead
                assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders
                assert r.num_output_placeholders <= (2 if pipelined else 1)
            in_flight.append((so, runner.execute(so)))
            dispatched = True
        if not in_flight or (pipelined and dispatched and len(in_flight) < 2):
            continue
        so, ro = in_flight.popleft()
        for out in sched.update_from_output(so, ro):
            prev = results.get(out.request_id, ((), None))
            assert prev[1] is None, f"{out.request_id} produced output after finishing"
            results[out.request_id] = (prev[0] + out.new_token_ids, out.finish_reason)
    return results


def _workload(seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 60) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    arrivals = {}
    for i in range(60):
        base = rng.choice(prefixes) if rng.random() < 0.5 else []
        prompt = (base + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 24))])[:40]
        params = dict(max_tokens=rng.randrange(1, 20), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(3, 53)]
        arrivals.setdefault(rng.randrange(1, 150), []).append((i, prompt, params))
    return arrivals


@pytest.mark.parametrize("seed,chunked,tokens", [(0, True, 16), (1, True, 24), (2, False, 48),
                                                 (3, True, 48)])
def test_pipelined_outputs_equal_synchronous(seed, chunked, tokens):
    outs, preemptions = {}, {}
    for pipelined in (False, True):
        sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=48,
                               max_num_batched_tokens=tokens, max_num_seqs=6,
                               enable_chunked_prefill=chunked)
        arrivals = {s: [make_request(i, p, arrival=s, **kw) for i, p, kw in reqs]
                    for s, reqs in _workload(seed).items()}
        outs[pipelined] = _drive(sched, FakeRunner(_token), arrivals, pipelined=pipelined)
        preemptions[pipelined] = sched.num_preemptions
        assert not sched.requests and not sched.kv.req_to_blocks
        assert sched.kv.get_num_free_blocks() == 15
    assert len(outs[True]) == 60
    assert outs[True] == outs[False]
    assert preemptions[True] > 0  # the tight cache preempted with tokens in flight


def test_pipelined_aborts_leak_nothing():
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=48,
                           max_num_batched_tokens=16, max_num_seqs=6)
    arrivals = {s: [make_request(i, p, arrival=s, **kw) for i, p, kw in reqs]
                for s, reqs in _workload(11).items()}
    _drive(sched, FakeRunner(_token), arrivals, pipelined=True, abort_rng=rng)
    assert not sched.requests and not sched.running and not len(sched.waiting)
    assert sched.kv.get_num_free_blocks() == 15 and not sched.kv.req_to_blocks


def test_token_in_flight_is_scheduled_and_the_last_one_is_not():
    """A decode whose previous token is still in flight is scheduled for it (one token);
    one whose in-flight token is its max_tokens-th is not scheduled again."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=48)
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=2, ignore_eos=True))
    runner = FakeRunner(_token)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"a": 3}
    ro1 = runner.execute(so1)
    req = sched.requests["a"]
    assert req.num_output_placeholders == 1 and req.num_tokens == 3
    so2 = sched.schedule()  # before step 1's token is known
    assert so2.num_scheduled_tokens == {"a": 1}
    ro2 = runner.execute(so2)
    assert req.num_output_placeholders == 2
    so3 = sched.schedule()  # tokens 1 and 2 in flight: 2 == max_tokens, nothing to do
    assert so3.num_scheduled_tokens == {}
    (o1,) = sched.update_from_output(so1, ro1)
    assert o1.new_token_ids == (_token("a", 3),) and not o1.finished
    (o2,) = sched.update_from_output(so2, ro2)
    assert o2.finish_reason is not None and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.kv.get_num_free_blocks() == 15
