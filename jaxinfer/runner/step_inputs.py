"""Host-side (numpy) construction of one step's flat, padded model inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class StepInputs:
    """One step's inputs, padded to a (T, R) bucket. Host numpy; transferred in one go."""

    input_ids: np.ndarray  # int32 [T]: token ids, sequences back to back, then padding (0)
    positions: np.ndarray  # int32 [T]: position of each token in its sequence
    slot_mapping: np.ndarray  # int32 [T]: KV slot (block * block_size + offset); padding -> 0
    block_tables: np.ndarray  # int32 [R, max_blocks]: block ids per sequence, 0-padded
    seq_lens: np.ndarray  # int32 [R]: KV length per sequence after this step (0 for padding)
    query_start_loc: np.ndarray  # int32 [R+1]: token offsets; padding rows repeat the total
    num_seqs: np.ndarray  # int32 [1]: real sequences in the step
    logits_indices: np.ndarray  # int32 [R]: index of each sequence's last token in the batch


def make_step_inputs(
    new_token_ids: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    num_tokens_padded: int,
    num_reqs_padded: int,
    max_blocks: int,
) -> StepInputs:
    """Flatten per-sequence work (the new tokens on top of num_computed_tokens cached ones)."""
    num_reqs = len(new_token_ids)
    q_lens = np.fromiter((len(t) for t in new_token_ids), np.int32, num_reqs)
    num_tokens = int(q_lens.sum())
    if num_tokens > num_tokens_padded or num_reqs > num_reqs_padded:
        raise ValueError(
            f"step of {num_tokens} tokens / {num_reqs} sequences exceeds the bucket "
            f"({num_tokens_padded} tokens / {num_reqs_padded} sequences)"
        )
    computed = np.asarray(num_computed_tokens, np.int32).reshape(num_reqs)
    query_start_loc = np.full(num_reqs_padded + 1, num_tokens, np.int32)
    query_start_loc[0] = 0
    np.cumsum(q_lens, out=query_start_loc[1 : num_reqs + 1])
    seq_lens = np.zeros(num_reqs_padded, np.int32)
    seq_lens[:num_reqs] = computed + q_lens

    tables = np.zeros((num_reqs_padded, max_blocks), np.int32)
    for i, blocks in enumerate(block_tables):
        if len(blocks) > max_blocks:
            raise ValueError(f"sequence {i} has {len(blocks)} blocks > max_blocks={max_blocks}")
        tables[i, : len(blocks)] = blocks

    input_ids = np.zeros(num_tokens_padded, np.int32)
    positions = np.zeros(num_tokens_padded, np.int32)
    slot_mapping = np.zeros(num_tokens_padded, np.int32)
    if num_tokens:
        input_ids[:num_tokens] = np.concatenate([np.asarray(t, np.int32) for t in new_token_ids])
        seq_of_token = np.repeat(np.arange(num_reqs), q_lens)
        offset_in_chunk = np.arange(num_tokens) - query_start_loc[seq_of_token]
        pos = computed[seq_of_token] + offset_in_chunk
        positions[:num_tokens] = pos
        slot_mapping[:num_tokens] = (
            tables[seq_of_token, pos // block_size] * block_size + pos % block_size
        )
    logits_indices = np.zeros(num_reqs_padded, np.int32)
    logits_indices[:num_reqs] = query_start_loc[1 : num_reqs + 1] - 1
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        num_seqs=np.array([num_reqs], np.int32),
        logits_indices=logits_indices,
    )
