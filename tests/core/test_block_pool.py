"""BlockPool, free queue, hashing and KVCacheManager: concrete vectors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxinfer.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.kv_cache_utils import hash_block_tokens, none_hash, update_block_hashes
from tests.core.fake import make_request


def test_free_queue_o1_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 2, 0] and q.num_free_blocks == 5
    with pytest.raises(RuntimeError):
        q.append(blocks[0])
    with pytest.raises(ValueError):
        q.popleft_n(6)


def test_null_block_is_reserved():
    pool = BlockPool(4, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # a no-op, never joins the free queue
    assert pool.get_num_free_blocks() == 0


def test_shared_prefix_block_assignment_and_ref_counts():
    kv = KVCacheManager(16, 4, 64)
    a = make_request("a", range(10))  # blocks: [0-3] [4-7] [8,9]
    assert kv.get_computed_blocks(a) == ([], 0)
    assert [b.block_id for b in kv.allocate_slots(a, 10)] == [1, 2, 3]
    a.num_computed_tokens = 10
    b = make_request("b", [*range(8), 50, 51, 52])  # shares the first two full blocks
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2] and n == 8
    new = kv.allocate_slots(b, 3, n, hits)
    assert [x.block_id for x in new] == [4]
    assert kv.get_block_ids("b") == [1, 2, 4]
    refs = {blk.block_id: blk.ref_cnt for blk in kv.block_pool.blocks[1:5]}
    assert refs == {1: 2, 2: 2, 3: 1, 4: 1}
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[1:5]] == [1, 1, 0, 1]
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert kv.get_num_free_blocks() == 15


def test_hit_length_leaves_last_token_to_compute():
    kv = KVCacheManager(16, 4, 64)
    a = make_request("a", range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)
    # Same 8 tokens: both blocks are cached, but only the first may be a hit.
    hits, n = kv.get_computed_blocks(make_request("b", range(8)))
    assert n == 4 and len(hits) == 1
    hits, n = kv.get_computed_blocks(make_request("c", range(9)))
    assert n == 8
    hits, n = kv.get_computed_blocks(make_request("d", [0, 1, 2, 99, 4, 5, 6, 7, 8]))
    assert n == 0
    st = kv.prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (3, 26, 12)


def test_free_queue_order_after_frees_is_tail_first():
    kv = KVCacheManager(8, 4, 64)
    a = make_request("a", range(12))
    kv.allocate_slots(a, 12)  # blocks 1, 2, 3
    b = make_request("b", range(100, 108))
    kv.allocate_slots(b, 8)  # blocks 4, 5
    kv.free(a)
    kv.free(b)
    # Untouched blocks first, then a's blocks tail-first, then b's.
    assert kv.block_pool.free_block_queue.block_ids() == [6, 7, 3, 2, 1, 5, 4]


def test_cache_hit_never_evicts_the_block_it_hits():
    kv = KVCacheManager(5, 4, 16)  # 4 usable blocks
    a = make_request("a", range(8))
    kv.allocate_slots(a, 8)  # blocks 1, 2
    kv.free(a)  # free queue: 3 4 2 1 -- block 1 (a's first block) is evicted last
    filler = make_request("f", range(200, 208))
    kv.allocate_slots(filler, 8)  # takes 3, 4
    assert kv.block_pool.free_block_queue.block_ids() == [2, 1]
    b = make_request("b", [0, 1, 2, 3, 70, 71, 72, 73, 74])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1] and n == 4
    # b needs 3 blocks: the hit (free, ref 0) plus 2 new. Only 2 are free in all, and one of
    # them is the hit itself, so this must fail and change nothing.
    assert kv.allocate_slots(b, 5, n, hits) is None
    assert kv.block_pool.free_block_queue.block_ids() == [2, 1]
    assert kv.block_pool.blocks[1].block_hash is not None and kv.get_block_ids("b") == []
    kv.free(filler)
    new = kv.allocate_slots(b, 5, n, hits)
    assert 1 not in [x.block_id for x in new]
    assert kv.get_block_ids("b")[0] == 1 and kv.block_pool.blocks[1].ref_cnt == 1


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(4, 4, 64)
    a = make_request("a", range(8))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    before = (kv.get_num_free_blocks(), kv.get_block_ids("a"))
    assert kv.allocate_slots(a, 8) is None  # needs 2 more, 1 free
    assert (kv.get_num_free_blocks(), kv.get_block_ids("a")) == before
    assert [b.block_id for b in kv.allocate_slots(a, 4)] == [3]


def test_lazy_eviction_and_reset_prefix_cache():
    kv = KVCacheManager(4, 4, 64)
    a = make_request("a", range(8))
    kv.allocate_slots(a, 8)
    assert not kv.reset_prefix_cache()  # blocks in use
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", range(9)))[1] == 8  # still findable
    kv.allocate_slots(make_request("c", range(50, 62)), 12)  # reallocates all: hashes cleared
    assert kv.get_computed_blocks(make_request("d", range(9)))[1] == 0
    kv.free(make_request("c", []))
    assert kv.reset_prefix_cache()
    assert kv.block_pool.cached_block_hash_to_block == {}


def test_block_hashes_chain_and_salt():
    root = none_hash(0)
    h0 = hash_block_tokens(root, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(root, [1, 2, 3, 4])
    assert h0 != hash_block_tokens(none_hash(1), [1, 2, 3, 4])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(root, [5, 6, 7, 8])
    a = make_request("a", range(9))
    s = make_request("s", range(9), cache_salt="tenant-1")
    update_block_hashes(a, 4, root)
    update_block_hashes(s, 4, root)
    assert len(a.block_hashes) == 2
    assert a.block_hashes[0] != s.block_hashes[0] and a.block_hashes[1] != s.block_hashes[1]


def test_salted_requests_do_not_share_blocks():
    kv = KVCacheManager(16, 4, 64)
    a = make_request("a", range(9), cache_salt="x")
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", range(9)))[1] == 0
    assert kv.get_computed_blocks(make_request("c", range(9), cache_salt="x"))[1] == 8


def test_hashes_are_deterministic_across_processes():
    code = ("from jaxinfer.core.kv_cache_utils import hash_block_tokens, none_hash;"
            "print(hash_block_tokens(none_hash(7), [1, 2, 3], ('salt', 'x')).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert outs == {hash_block_tokens(none_hash(7), [1, 2, 3], ("salt", "x")).hex()}


def test_core_never_imports_jax():
    code = ("import sys, jaxinfer.core.scheduler, jaxinfer.core.kv_cache_manager;"
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
