"""Bucketed step shapes: the only static dimensions (our replacement for CUDA graphs)."""

from __future__ import annotations

from dataclasses import dataclass


def geometric_buckets(smallest: int, largest: int, growth: int = 2) -> tuple[int, ...]:
    """smallest, smallest*growth, ... capped by (and always including) largest."""
    if smallest < 1 or largest < 1 or growth < 2:
        raise ValueError(f"bad bucket range: smallest={smallest} largest={largest} growth={growth}")
    out, b = [], min(smallest, largest)
    while b < largest:
        out.append(b)
        b *= growth
    out.append(largest)
    return tuple(out)


@dataclass(frozen=True)
class BucketTable:
    """(T, R) buckets: T tokens of R sequences in one step, R <= T."""

    token_buckets: tuple[int, ...]  # ascending
    req_buckets: tuple[int, ...]  # ascending

    @staticmethod
    def build(max_num_batched_tokens: int, max_num_seqs: int, *, min_tokens: int = 16,
              growth: int = 2) -> "BucketTable":
        return BucketTable(geometric_buckets(min_tokens, max_num_batched_tokens, growth),
                           geometric_buckets(1, max_num_seqs, growth))

    def pick(self, num_tokens: int, num_reqs: int) -> tuple[int, int]:
        t = next((b for b in self.token_buckets if b >= num_tokens), None)
        r = next((b for b in self.req_buckets if b >= num_reqs), None)
        if t is None or r is None:
            raise ValueError(f"step of {num_tokens} tokens / {num_reqs} sequences exceeds the "
                             f"largest bucket ({self.token_buckets[-1]} / {self.req_buckets[-1]})")
        return t, min(r, self._max_reqs_for(t))

    def _max_reqs_for(self, t: int) -> int:
        return next((r for r in self.req_buckets if r >= t), self.req_buckets[-1])

    def start_pairs(self) -> list[tuple[int, int]]:
        """The buckets compiled before an engine serves (the others compile when first used
        or in the background): the bucket of a pure decode step of each request count, what
        every decode step uses. A first prompt compiles its own bucket when it comes (~2 s
        here); nobody waits for the largest buckets at start-up."""
        return sorted({self.pick(r, r) for r in self.req_buckets})

    def all_pairs(self) -> list[tuple[int, int]]:
        """Every (T, R) a step can map to: R up to the first request bucket >= T."""
        return [(t, r) for t in self.token_buckets for r in self.req_buckets
                if r <= self._max_reqs_for(t)]
