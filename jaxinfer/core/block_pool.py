"""KV-cache blocks, the free-block queue (O(1) everywhere) and the block pool.

Pure Python. Block 0 is the null block: never handed out, never freed. A freed block keeps its
hash and stays findable through the hash map until it is reallocated (lazy eviction); the free
queue is LRU: popleft evicts the least recently freed block.
"""

from __future__ import annotations

from typing import Iterable


def cdiv(a: int, b: int) -> int:
    """Blocks of b tokens that a tokens take."""
    return -(-a // b)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
        self.prev_free: KVCacheBlock | None = None  # links of the free queue
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinels: popleft, append and remove are O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def prepend(self, block: KVCacheBlock) -> None:
        """Put a block at the front: it is the next one popleft hands out."""
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        first = self._head.next_free
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Front (evicted first) to back; for tests and debugging."""
        out, b = [], self._head.next_free
        while b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """All KV blocks of one cache: allocation, ref counts, and the hash -> cached block map."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # hash -> {block_id: block}; several blocks may hold the same content.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}

    # -- lookup ---------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    # -- allocation -----------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the free queue (evicting their cached hashes), ref_cnt = 1."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for b in blocks:
            assert b.ref_cnt == 0, b
            self._evict(b)
            b.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        same = self.cached_block_hash_to_block.get(block.block_hash)
        if same is not None:
            same.pop(block.block_id, None)
            if not same:
                del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on blocks given in eviction order (first = evict first).

        Blocks reaching 0 that hold no prefix-cache hash can never be hit: they go to the front
        of the free queue and are reused first. Hashed blocks join the tail in the given order,
        so cached prefixes survive as long as possible (LRU), as in vLLM."""
        unhashed = []
        for b in ordered_blocks:
            if b.is_null:
                continue
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    unhashed.append(b)
                else:
                    self.free_block_queue.append(b)
        for b in reversed(unhashed):  # the first given ends up at the very front
            self.free_block_queue.prepend(b)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if block.block_hash is not None:
            return  # already cached (a hit, or cached in an earlier step)
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    # -- whole-cache operations -----------------------------------------------------------------
    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that are in use."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, unless
        `force` (the weights changed: blocks in use keep their KV for their request, but no
        later request may hit them)."""
        if not force and self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for b in self.blocks:
            b.block_hash = None
        return True
