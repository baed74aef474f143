"""Seeded randomized driver: thousands of steps with a fake runner, invariants after each."""

from __future__ import annotations

import random
import zlib
from collections import defaultdict

import pytest

from jaxinfer.request import RequestStatus
from tests.core.fake import FakeRunner, make_request, make_scheduler


def _token(rid, n):
    return 3 + zlib.crc32(f"{rid}:{n}".encode()) % 50 if n % 7 else 2  # EOS now and then


def check_invariants(sched, so):
    cfg = sched.config
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
    assert len(sched.running) <= cfg.max_num_seqs
    pool = sched.kv.block_pool
    owners = defaultdict(list)
    for rid, blocks in sched.kv.req_to_blocks.items():
        assert rid in sched.requests, f"blocks held by finished request {rid}"
        for idx, b in enumerate(blocks):
            owners[b.block_id].append((rid, idx))
    free_ids = set(pool.free_block_queue.block_ids())
    assert 0 not in free_ids and 0 not in owners
    for bid, owned in owners.items():
        block = pool.blocks[bid]
        assert block.ref_cnt == len(owned), (block, owned)
        assert bid not in free_ids
        if len(owned) > 1:  # shared: only as the same full block of identical prefixes
            assert block.block_hash is not None
            idxs = {idx for _, idx in owned}
            assert len(idxs) == 1
            idx = idxs.pop()
            hashes = {sched.requests[rid].block_hashes[idx] for rid, _ in owned}
            assert hashes == {block.block_hash}
    for bid in free_ids:
        assert pool.blocks[bid].ref_cnt == 0
    assert len(free_ids) + len(owners) == pool.num_blocks - 1
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert r.num_computed_tokens <= r.num_tokens


@pytest.mark.parametrize("seed,policy,chunked,caching", [
    (0, "fcfs", True, True), (1, "priority", True, True), (2, "fcfs", False, True),
    (3, "priority", True, False), (4, "fcfs", True, False), (5, "priority", False, True),
])
def test_random_workload(seed, policy, chunked, caching):
    rng = random.Random(seed)
    max_model_len = 48
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=max_model_len,
                           max_num_batched_tokens=48 if not chunked else rng.choice([16, 24, 48]),
                           max_num_seqs=rng.choice([3, 6]), policy=policy,
                           enable_chunked_prefill=chunked, caching=caching,
                           long_prefill_token_threshold=rng.choice([0, 8]))
    runner = FakeRunner(_token)
    prefixes = [[rng.randrange(3, 60) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    submitted, aborted, finished = {}, set(), set()
    steps, next_id = 0, 0
    while steps < 2500 or sched.has_unfinished_requests():
        steps += 1
        assert steps < 20000, "requests stopped making progress"
        if steps < 2500 and rng.random() < 0.35:
            base = rng.choice(prefixes) if rng.random() < 0.6 else []
            tail = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 24))]
            prompt = (base + tail)[: rng.randrange(1, max_model_len + 1)]
            req = make_request(next_id, prompt, priority=rng.randrange(3), arrival=steps,
                               max_tokens=rng.randrange(1, 20), ignore_eos=rng.random() < 0.5)
            sched.add_request(req)
            submitted[req.request_id] = req
            next_id += 1
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort(victim)
            aborted.add(victim)
        so = sched.schedule()
        check_invariants(sched, so)
        ro = runner.execute(so)
        if rng.random() < 0.02 and so.num_scheduled_tokens:  # abort while the step "runs"
            victim = rng.choice(sorted(so.num_scheduled_tokens))
            sched.abort(victim)
            aborted.add(victim)
        for out in sched.update_from_output(so, ro):
            if out.finished:
                finished.add(out.request_id)
        check_invariants(sched, so)

    assert not sched.requests and not sched.running and not len(sched.waiting)
    assert set(submitted) == finished | aborted
    assert sched.kv.get_num_free_blocks() == 15
    assert not sched.kv.req_to_blocks
    for rid in finished - aborted:
        req = submitted[rid]
        assert req.is_finished()
        # Recompute after preemption must not change what the (deterministic) runner produced.
        p = req.num_prompt_tokens
        assert req.output_token_ids == [_token(rid, p + i) for i in range(req.num_output_tokens)]
    assert sched.num_preemptions > 0  # the cache was tight enough to matter
