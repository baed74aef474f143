"""N-gram prompt lookup: drafts from the request's own history, on the host (numpy).

For each request the longest suffix of n tokens (prompt_lookup_max >= n >= prompt_lookup_min)
that also occurs earlier in its tokens (prompt and output) proposes the up to k tokens that
followed its most recent earlier occurrence. The search is vectorised over the batch: one
sliding-window comparison per n over a [B, L] array of the requests' tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, k: int):
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"bad n-gram proposer settings: min_n={min_n} max_n={max_n} k={k}")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray
                ) -> list[list[int]]:
        """token_ids [S, L]: row rows[b] holds lengths[b] tokens. Returns up to k drafts per
        requested row (an empty list: no match)."""
        b = len(rows)
        out: list[list[int]] = [[] for _ in range(b)]
        if b == 0:
            return out
        lengths = lengths.astype(np.int64)
        width = int(lengths.max())
        toks = token_ids[rows, :width]  # [B, W]
        todo = lengths > self.min_n  # a match needs the suffix plus an earlier n-gram
        k = self.k
        for n in range(self.max_n, self.min_n - 1, -1):
            if not todo.any() or width <= n:
                continue
            idx = np.nonzero(todo & (lengths > n))[0]
            if len(idx) == 0:
                continue
            sub = toks[idx]
            suffix = np.take_along_axis(sub, lengths[idx, None] - n + np.arange(n)[None, :], 1)
            windows = sliding_window_view(sub[:, : width - 1], n, axis=1)  # [b, W-n, n]
            match = (windows == suffix[:, None, :]).all(-1)  # [b, W-n]
            # An earlier occurrence ends before the suffix does (start + n < length).
            starts = np.arange(match.shape[1])[None, :]
            match &= starts + n < lengths[idx, None]
            found = match.any(1)
            last = match.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)  # most recent
            for row, start, ok in zip(idx, last, found):
                if ok:
                    begin = start + n
                    end = min(begin + k, int(lengths[row]))
                    out[row] = toks[row, begin:end].tolist()
                    todo[row] = False
        return out
