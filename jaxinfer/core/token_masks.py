"""vLLM's allowed_token_ids and bad_words as rows of the step's token bitmask (the one that
carries grammars: int32 words, bit j of word i set = token 32 * i + j may be sampled). The
step applies the rows on the device; here the host decides which bits are set: a request's
allowed tokens once (a fixed row), and before each step the last token of every bad word
whose other tokens end the output (vLLM's rule; a one-token word is always masked)."""

from __future__ import annotations

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allowed_row(token_ids, width: int) -> np.ndarray:
    """The row allowing exactly `token_ids`."""
    row = np.zeros(width, np.uint32)
    ids = np.asarray(token_ids, np.int64)
    ids = ids[ids < width * 32]
    np.bitwise_or.at(row, ids // 32, np.uint32(1) << (ids % 32).astype(np.uint32))
    return row.view(np.int32)


def banned_next(output_ids: list[int], words: list[list[int]]) -> list[int]:
    """The tokens no bad word may end with next: a word's last token when the output ends
    with the rest of it."""
    out = []
    n = len(output_ids)
    for w in words:
        k = len(w) - 1
        if k == 0 or (k <= n and output_ids[n - k:] == w[:k]):
            out.append(w[-1])
    return out


def clear_bits(row: np.ndarray, token_ids) -> None:
    ids = np.asarray(token_ids, np.int64)
    ids = ids[ids < row.shape[0] * 32]
    if ids.size:
        u = row.view(np.uint32)
        np.bitwise_and.at(u, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))


def apply_request_masks(row: np.ndarray, request) -> None:
    """AND a request's allowed_token_ids and bad words into its bitmask row (in place). A
    row left with nothing allowed allows EOS (or everything without one), so the sampler
    never picks among masked tokens."""
    p = request.sampling_params
    if p.allowed_token_ids is not None:
        if request.allowed_row is None:
            request.allowed_row = allowed_row(p.allowed_token_ids, row.shape[0])
        row &= request.allowed_row
    if p.bad_words_token_ids:
        clear_bits(row, banned_next(request.output_token_ids, p.bad_words_token_ids))
    if not row.any():
        eos = request.eos_token_id
        if eos is None or eos >= row.shape[0] * 32:
            row[:] = -1
        else:
            row[eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))


def step_bitmask(rows: list, grammars, width: int, errors: dict[str, str]) -> np.ndarray:
    """The bitmask rows of the requests in `rows` (each has a grammar or a token mask): the
    grammar's row (`grammars`: the StructuredOutputManager; failures recorded in `errors`)
    or all ones, ANDed with the request's allowed tokens and bad words."""
    grammar = [i for i, r in enumerate(rows) if r.grammar is not None]
    masked = [i for i, r in enumerate(rows) if r.uses_token_mask]
    if len(grammar) == len(rows) and not masked:
        return grammars.grammar_bitmask(rows, errors)
    bitmask = np.full((len(rows), width), -1, np.int32)
    if grammar:
        bitmask[grammar] = grammars.grammar_bitmask([rows[i] for i in grammar], errors)
    for i in masked:
        apply_request_masks(bitmask[i], rows[i])
    return bitmask


def needs_last_tokens(rows: list) -> bool:
    """Some row's mask depends on the tokens sampled last (a grammar, bad words)."""
    return any(r.grammar is not None or r.sampling_params.bad_words_token_ids for r in rows)
