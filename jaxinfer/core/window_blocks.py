"""The sliding-window layers' own KV blocks (models that mix sliding and full layers).

In a model such as gpt-oss or Gemma 3 a sliding layer's query at position p reads only the
keys of [p - W + 1, p]. Those layers get a block pool of their own; each request holds a
second block list in it, indexed like its main list (logical block j covers the same tokens),
where the blocks wholly before the window are handed back as the request advances and their
entries become the null block. The main pool (full layers) is unchanged. vLLM's hybrid KV
cache manager does the same with its sliding-window group (SlidingWindowSpec).

Prefix caching: a window block is published under the same chained hash as the main block of
the same tokens, and a freed one stays findable until it is reused (lazy eviction, as in the
main pool). A prefix hit of n blocks is usable only when the window blocks of its last
W - 1 tokens are still cached too (a sliding layer's next query reads them), so the hit the
scheduler gets is the longest one both pools can serve.

Speculative decoding: the scheduler counts scheduled drafts as computed until the step
verifies them, and a rejection moves the count back by up to `margin` tokens, so freeing
keeps `margin` more tokens than the window needs.
"""

from __future__ import annotations

from jaxinfer.core.block_pool import BlockPool, KVCacheBlock, cdiv


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int,
                       max_num_batched_tokens: int, margin: int = 0) -> int:
    """Window blocks (the null block included) that never run out when the scheduler frees
    every running request's out-of-window blocks before it schedules (Scheduler.schedule).
    A request at p computed tokens, scheduling C more (drafts included) with L lookahead
    slots, then holds the blocks from floor((p - W + 1 - margin) / B) to ceil((p + C + L) /
    B): fewer than (C + L + W - 1 + margin) / B + 2. Summed over max_num_seqs requests, whose
    C add up to max_num_batched_tokens at most (L <= margin: drafts)."""
    held = (max_num_seqs * (window - 1 + 2 * margin + 2 * block_size)
            + max_num_batched_tokens)
    return cdiv(held, block_size) + 1


class WindowBlocks:
    """Per-request block lists in the sliding layers' pool."""

    def __init__(self, num_blocks: int, block_size: int, window: int, *,
                 enable_caching: bool = True, margin: int = 0):
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.block_size = block_size
        self.window = window
        self.margin = margin
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_skipped: dict[str, int] = {}  # leading places already null
        # Block ids appended since the runner last heard of the request (its step diff).
        self.new_ids: dict[str, list[int]] = {}

    @property
    def window_blocks(self) -> int:
        """Blocks holding the W - 1 tokens before a block boundary."""
        return cdiv(self.window - 1, self.block_size)

    # -- prefix hits ----------------------------------------------------------------------------
    def hit_blocks(self, block_hashes, n: int) -> list[KVCacheBlock] | None:
        """The cached window blocks a hit of n main blocks needs (the last window_blocks of
        them), or None when one is missing."""
        out = []
        for h in block_hashes[max(0, n - self.window_blocks):n]:
            block = self.pool.get_cached_block(h)
            if block is None:
                return None
            out.append(block)
        return out

    def longest_hit(self, block_hashes, n: int) -> int:
        """The longest hit of at most n blocks whose window blocks are cached."""
        while n > 0 and self.hit_blocks(block_hashes, n) is None:
            n -= 1
        return n

    # -- allocation -----------------------------------------------------------------------------
    def num_to_allocate(self, request_id: str, num_required: int, num_computed: int) -> int:
        """New blocks an allocation up to num_required blocks takes (a first one starts
        after the blocks of its prefix hit, which end at num_computed)."""
        held = self.req_to_blocks.get(request_id)
        have = num_computed // self.block_size if held is None else len(held)
        return max(num_required - have, 0)

    def can_allocate(self, n: int, hits: list[KVCacheBlock]) -> bool:
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return n <= self.pool.get_num_free_blocks() - evictable_hits

    def allocate(self, request_id: str, num_required: int, num_computed: int,
                 hits: list[KVCacheBlock]) -> None:
        """Extend the request's list to num_required blocks (hits: the window blocks of a
        prefix hit ending at num_computed, taken now; a first allocation fills the skipped
        places before them with the null block)."""
        held = self.req_to_blocks.get(request_id)
        null = self.pool.null_block
        if held is None:
            held = self.req_to_blocks[request_id] = []
            start = num_computed // self.block_size
            self.pool.touch(hits)
            held.extend([null] * (start - len(hits)))
            held.extend(hits)
            self.num_cached_blocks[request_id] = len(held)
            self.new_ids.setdefault(request_id, []).extend(b.block_id for b in held)
        n = num_required - len(held)
        if n > 0:
            new = self.pool.get_new_blocks(n)
            held.extend(new)
            self.new_ids.setdefault(request_id, []).extend(b.block_id for b in new)

    def _first_kept(self, num_computed: int) -> int:
        """Index of the first block the next query still reads (the ones before it may go)."""
        skipped = num_computed - (self.window - 1) - self.margin
        return max(skipped, 0) // self.block_size

    def free_out_of_window(self, request_id: str, num_computed: int) -> int:
        """Hand back the request's blocks wholly before the window of its next token (its
        list keeps their places as null blocks). Returns how many were freed."""
        held = self.req_to_blocks.get(request_id)
        if not held:
            return 0
        null = self.pool.null_block
        start = self.num_skipped.get(request_id, 0)
        end = min(self._first_kept(num_computed), len(held))
        freed = []
        for i in range(start, end):
            if held[i] is not null:
                freed.append(held[i])
                held[i] = null
        if end > start:
            self.num_skipped[request_id] = end
            self.pool.free_blocks(freed)
        return len(freed)

    def cache_blocks(self, request_id: str, block_hashes, num_full: int) -> None:
        held = self.req_to_blocks[request_id]
        done = self.num_cached_blocks.get(request_id, 0)
        for i in range(done, min(num_full, len(held))):
            if not held[i].is_null:
                self.pool.cache_full_block(held[i], block_hashes[i])
        self.num_cached_blocks[request_id] = max(done, num_full)

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.num_skipped.pop(request_id, None)
        self.new_ids.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        self.new_ids.pop(request_id, None)
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def pop_new_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self.new_ids.pop(request_id, ()))
