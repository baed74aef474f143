"""KVCacheManager: per-request block lists over the BlockPool, with prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.core.block_pool import BlockPool, KVCacheBlock, cdiv
from jaxinfer.core.kv_cache_utils import none_hash, update_block_hashes
from jaxinfer.core.window_blocks import WindowBlocks
from jaxinfer.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset: requests, prompt tokens queried and hit."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, *,
                 enable_caching: bool = True, hash_algo: str = "sha256", hash_seed: int = 0,
                 window: int | None = None, window_blocks: int = 0, window_margin: int = 0):
        """window, window_blocks: a model with sliding and full layers keeps its sliding
        layers' KV in a pool of its own of window_blocks blocks (core/window_blocks.py);
        window_margin: tokens a rejected draft may move a request back by."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.root_hash = none_hash(hash_seed)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of each request already hashed
        self.prefix_cache_stats = PrefixCacheStats()
        self.window = (WindowBlocks(window_blocks, block_size, window,
                                    enable_caching=enable_caching, margin=window_margin)
                       if window_blocks else None)

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # -- prefix cache ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in full blocks, leaving >= 1 token to compute
        (its logits are needed). Returns (blocks, num_computed_tokens)."""
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        update_block_hashes(request, self.block_size, self.root_hash, self.hash_algo)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.window is not None:  # the sliding layers' blocks of the hit's end are cached too
            hits = hits[:self.window.longest_hit(request.block_hashes, len(hits))]
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def reset_prefix_cache(self, force: bool = False) -> bool:
        ok = self.block_pool.reset_prefix_cache(force)
        if ok and self.window is not None:
            ok = self.window.pool.reset_prefix_cache(force)
        if ok:
            self.prefix_cache_stats = PrefixCacheStats()
        return ok

    # -- allocation -----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None, *,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, full_sequence_must_fit: bool = False
                       ) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens on top of the request's computed ones.
        Returns the newly allocated blocks, or None when the pool cannot supply them; a failed
        call changes nothing. Layout of the request's slots after the call:

            | computed | new_computed (prefix hits) | external | new | lookahead |

        new_computed_blocks: prefix-cache hits taken now (num_new_computed_tokens of them).
        num_external_computed_tokens: tokens whose KV a KV connector brings in (they get slots
            and count as computed; num_new_tokens may then be 0, an async load).
        num_lookahead_tokens: extra slots past the new tokens (speculative drafts' KV); never
            cached (caching stops at request.num_tokens, which excludes drafts).
        delay_cache_blocks: do not publish blocks in the prefix cache yet (their KV is still
            being received).
        full_sequence_must_fit: admit only if the pool could hold the request's whole current
            sequence (prompt, or prompt + outputs when resumed), not just this chunk: an
            admission gate against over-admitting chunked prefills that would later preempt
            each other (vLLM's scheduler_reserve_full_isl)."""
        if num_new_tokens < 0 or (num_new_tokens == 0 and num_external_computed_tokens == 0):
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = (request.num_computed_tokens + num_new_computed_tokens
                        + num_external_computed_tokens)
        num_tokens_need_slot = min(num_computed + num_new_tokens + num_lookahead_tokens,
                                   self.max_model_len)
        num_required = -(-num_tokens_need_slot // self.block_size)
        hits = new_computed_blocks or []
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        # (the sliding pool's out-of-window blocks went back when the step began:
        # free_out_of_window, called by the scheduler for every running request)
        window, window_hits = self.window, []
        if window is not None and hits:
            window_hits = window.hit_blocks(request.block_hashes, len(hits))
            if window_hits is None:
                raise RuntimeError("a prefix hit whose sliding-window blocks are gone")
        if full_sequence_must_fit:
            full = self.blocks_needed(request.num_tokens)
            if (max(full - len(req_blocks) - len(hits), 0)
                    > self.block_pool.get_num_free_blocks() - num_evictable_hits):
                return None
        cache_upto = min(num_computed + num_new_tokens, request.num_tokens)
        caching = self.enable_caching and not delay_cache_blocks
        if not hits and num_required <= len(req_blocks):
            # The common decode step: the last block still has room.
            if caching:
                self._cache_blocks(request, cache_upto)
            return []
        num_new_blocks = max(num_required - len(req_blocks) - len(hits), 0)
        # Free hits leave the free queue when touched, so they compete with new blocks.
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        if window is not None and not window.can_allocate(
                window.num_to_allocate(request.request_id, num_required, num_computed),
                window_hits):
            return None

        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        if hits:
            self.block_pool.touch(hits)
            req_blocks.extend(hits)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if window is not None:
            window.allocate(request.request_id, num_required, num_computed, window_hits)
        if caching:
            # Blocks filled by this step become findable now: the step writes every token's KV
            # before any attention reads it, so a request admitted later in the same step may
            # already hit them (as in vLLM).
            self._cache_blocks(request, cache_upto)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks up to num_tokens (after a delayed KV receive)."""
        if self.enable_caching:
            self._cache_blocks(request, min(num_tokens, request.num_tokens))

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        update_block_hashes(request, self.block_size, self.root_hash, self.hash_algo)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(done, num_full):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full
        if self.window is not None:
            self.window.cache_blocks(request.request_id, request.block_hashes, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: a prefix's first blocks are evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        if self.window is not None:
            self.window.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free_out_of_window(self, requests) -> None:
        """Hand back the sliding-pool blocks that the requests' next tokens no longer read
        (the scheduler calls this first thing each step, for every running request; the
        pool's size counts on it: core/window_blocks.py)."""
        if self.window is not None:
            for r in requests:
                self.window.free_out_of_window(r.request_id, r.num_computed_tokens)

    def get_window_block_ids(self, request_id: str) -> tuple[int, ...]:
        """Every block of the request in the sliding layers' pool (null where freed); () for a
        model without one."""
        return () if self.window is None else tuple(self.window.block_ids(request_id))

    def pop_new_window_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's sliding-pool blocks appended since its last step diff."""
        return () if self.window is None else self.window.pop_new_ids(request_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(min(num_tokens, self.max_model_len), self.block_size)
