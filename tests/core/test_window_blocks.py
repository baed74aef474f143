"""The sliding layers' own block pool (core/window_blocks.py) inside the KVCacheManager, and
the scheduler over it: blocks freed as the window moves, prefix hits that both pools serve,
the pool size that never runs out."""

from __future__ import annotations

import random

from jaxinfer.config import SchedulerConfig
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.window_blocks import WindowBlocks, window_pool_blocks
from tests.core.fake import FakeRunner, make_request


def _held(kv, rid):
    """(main blocks, live window blocks, window list length) of a request."""
    w = kv.window.req_to_blocks[rid]
    return len(kv.req_to_blocks[rid]), sum(not b.is_null for b in w), len(w)


def _advance(kv, req, n):
    """One step of one request, as the scheduler takes it: out-of-window blocks back, then
    the new tokens' slots."""
    kv.free_out_of_window([req])
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n


def test_blocks_before_the_window_are_freed_and_their_places_kept():
    bs, window = 4, 6  # the next query reads the 5 tokens before it: 2 blocks at most
    kv = KVCacheManager(64, bs, 128, window=window, window_blocks=16)
    req = make_request("a", range(40))
    _advance(kv, req, 8)  # a chunk of 8: both pools hold its 2 blocks
    assert _held(kv, "a") == (2, 2, 2)
    _advance(kv, req, 8)  # computed 8: tokens 3.. are read, block 0 (0-3) is still needed
    assert _held(kv, "a") == (4, 4, 4)
    _advance(kv, req, 24)  # computed 16: tokens 11.. are read, blocks 0 and 1 go
    assert _held(kv, "a") == (10, 8, 10)
    free = kv.window.pool.get_num_free_blocks()
    kv.free_out_of_window([req])  # computed 40: 35.. read
    assert _held(kv, "a") == (10, 2, 10) and kv.window.pool.get_num_free_blocks() == free + 6
    # The runner heard of every block once, in list order (freed ones keep their ids there).
    ids = kv.pop_new_window_block_ids("a")
    assert len(ids) == 10 and 0 not in ids and kv.pop_new_window_block_ids("a") == ()
    assert kv.get_window_block_ids("a")[:8] == (0,) * 8
    kv.free(req)
    assert kv.window.pool.get_num_free_blocks() == 15 and not kv.window.req_to_blocks
    assert kv.get_num_free_blocks() == 63


def test_decode_keeps_the_window_blocks_only():
    bs, window = 4, 8
    kv = KVCacheManager(64, bs, 256, window=window, window_blocks=8)
    req = make_request("a", range(10))
    _advance(kv, req, 10)
    most = 0
    for _ in range(100):  # one token a step: never more than the window's 7 tokens + 1
        _advance(kv, req, 1)
        most = max(most, _held(kv, "a")[1])
    assert _held(kv, "a")[0] == 28 and most <= 3  # 110 tokens in 28 blocks; 3 live


def test_margin_keeps_tokens_a_rejected_draft_moves_back_to():
    w = WindowBlocks(16, 4, 5, margin=3)
    assert w._first_kept(16) == (16 - 4 - 3) // 4  # 9 // 4: 2 blocks may go, not 3
    assert WindowBlocks(16, 4, 5)._first_kept(16) == 3


def test_prefix_hit_needs_the_window_blocks_of_its_end():
    bs, window = 4, 6
    kv = KVCacheManager(64, bs, 128, window=window, window_blocks=12)
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks can hit
    a = make_request("a", prompt)
    _advance(kv, a, 33)
    kv.free(a)
    b = make_request("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert len(hits) == 8 and n == 32  # the window blocks of the hit's end are still cached
    assert kv.allocate_slots(b, 1, n, hits) is not None
    main, live, length = _held(kv, "b")
    assert (main, length) == (9, 9) and live == 3  # blocks 6, 7 hit; block 8 new
    kv.free(b)
    # Another request takes every free window block: the cached ones are evicted.
    c = make_request("c", range(500, 544))
    _advance(kv, c, 44)
    d = make_request("d", prompt)
    hits, n = kv.get_computed_blocks(d)
    assert n == 0 and hits == []  # the main pool still has the prefix; the sliding one not
    assert kv.get_computed_blocks(make_request("e", prompt[:13]))[1] == 0


def test_prefix_hit_shortened_to_where_the_window_pool_still_has_blocks():
    bs, window = 4, 5  # one block of window before a hit's end
    kv = KVCacheManager(64, bs, 128, window=window, window_blocks=40)
    prompt = list(range(100, 125))
    a = make_request("a", prompt)
    _advance(kv, a, 25)
    # Evict the window pool's copy of block 5 only: hits may end at block 5 (needs 4) but
    # not at 6 (needs 5).
    w = kv.window
    block5 = w.pool.get_cached_block(a.block_hashes[5])
    w.pool._evict(block5)
    kv.free(a)
    hits, n = kv.get_computed_blocks(make_request("b", prompt))
    assert n == 20 and len(hits) == 5


def test_too_few_window_blocks_fail_the_allocation_and_change_nothing_in_the_main_pool():
    kv = KVCacheManager(64, 4, 128, window=6, window_blocks=4)
    req = make_request("a", range(30))
    assert kv.allocate_slots(req, 16) is None  # 4 window blocks; 3 usable
    assert kv.get_num_free_blocks() == 63 and "a" not in kv.req_to_blocks
    assert kv.allocate_slots(req, 12) is not None


def test_scheduler_never_runs_the_bounded_pool_dry():
    """Random prompts, chunked prefill, preemption by the main pool and prefix hits, with the
    window pool at window_pool_blocks: no allocation ever fails for the window pool's sake,
    no block leaks."""
    bs, window, seqs, budget = 4, 7, 5, 24
    n_window = window_pool_blocks(window, bs, seqs, budget)
    kv = KVCacheManager(40, bs, 96, window=window, window_blocks=n_window)
    sched = Scheduler(SchedulerConfig(max_model_len=96, max_num_seqs=seqs,
                                      max_num_batched_tokens=budget,
                                      long_prefill_token_threshold=10), kv)
    dry = []
    can = kv.window.can_allocate
    kv.window.can_allocate = lambda n, hits: dry.append(n) or can(n, hits) or dry.append(-1)
    rng = random.Random(0)
    runner = FakeRunner()
    shared = [rng.randrange(1000) for _ in range(12)]
    for i in range(30):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000)
                                                   for _ in range(rng.randrange(3, 40))]
        sched.add_request(make_request(i, prompt, max_tokens=rng.randrange(1, 30),
                                       ignore_eos=True))
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    assert not sched.has_unfinished_requests() and -1 not in dry and dry
    assert sched.make_stats()["num_preemptions"] > 0
    assert kv.window.pool.get_num_free_blocks() == n_window - 1 and not kv.window.req_to_blocks
    assert kv.get_num_free_blocks() == 39
