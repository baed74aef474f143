"""One step's inputs on the host: the compile key of its variant (StepFeatures), the padded
numpy buffers (StepBatch, a pytree that crosses to the device in one transfer) and the numpy
code that fills them from the runner's persistent InputBatch."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.sampler import SamplingMetadata


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """The compile key of a step variant beside its (T, R) bucket: a step pays only for the
    features its requests use. A plain greedy/random step computes no logprobs, ranks, top-k or
    penalties and copies back only the sampled ids."""

    logprobs: bool = False  # some request wants the sampled tokens' logprobs
    penalties: bool = False  # some request uses repetition / frequency / presence penalties
    prompt_logprobs: bool = False  # some request wants prompt logprobs from this step
    structured: bool = False  # some request samples under a grammar (a token bitmask)
    # Speculative decoding is on: the step verifies drafts (rejection sampling over each
    # request's 1 + d_i verify positions; every step of such an engine uses this variant).
    spec: bool = False
    # (spec) some row verifies drafts: N = min(T, R * (K+1)) verify positions; else N = R,
    # so a step without drafts computes the LM head on R rows only, as a plain step does.
    verify: bool = False
    # logit_bias: entries per row, a bucket of LOGIT_BIAS_BUCKETS (0: no row has any)
    bias: int = 0
    # The engine's custom logits processors, when some row uses one (else empty): the step
    # traces their apply() in.
    logits_processors: tuple = ()
    # A pooling engine (runner="pooling"): "LAST" | "MEAN" | "CLS"; the step returns each
    # row's pooled final hidden state (MEAN: the row's sum) instead of sampling ("": off).
    pooling: str = ""
    # Some row's chunk holds image tokens: the step carries their encoder rows
    # (StepBatch.mm_embeds / mm_mask), put in place of those tokens' embeddings.
    mm: bool = False

    def __str__(self) -> str:
        on = [f.name if f.name not in ("bias", "pooling") else
              f"{f.name}{getattr(self, f.name)}"
              for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "+".join(on) or "plain"


# logit_bias entries a step carries per row: the smallest bucket that holds every row's.
LOGIT_BIAS_BUCKETS = (16, 128, 1024)


def logit_bias_bucket(n: int) -> int:
    return 0 if n == 0 else next(k for k in LOGIT_BIAS_BUCKETS if k >= n)


PLAIN = StepFeatures()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Everything one step needs, padded to its (T, R) bucket."""

    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    attn: AttentionMetadata  # slot_mapping [T], block_tables [R, B], seq_lens [R], qsl [R+1]
    logits_indices: np.ndarray  # int32 [R]: last token of each sequence
    token_slots: np.ndarray  # int32 [T]: persistent slot of each token's request (pad: S)
    token_is_output: np.ndarray  # bool [T]: token is a generated one (frequency/presence)
    req_slots: np.ndarray  # int32 [R]: persistent slot of each sequence (pad: 0)
    reset_slots: np.ndarray  # int32 [R]: slots whose penalty state restarts (pad: S)
    sampling: SamplingMetadata  # [R] each
    # bool [T]: the token is the one the previous step sampled for this request, still on the
    # device (async scheduling): the step reads it from its slot's last sampled id.
    from_last_sampled: np.ndarray
    next_token_ids: np.ndarray | None = None  # int32 [T]: next prompt token (prompt_logprobs)
    # int32 [R, ceil(V/32)]: bit j of word i set = token 32*i+j allowed (structured outputs;
    # rows without a grammar are all ones).
    bitmask: np.ndarray | None = None
    # Speculative decoding (StepFeatures.spec), N = min(T, R * (K+1)) verify positions:
    verify_indices: np.ndarray | None = None  # int32 [N]: token index of each position
    verify_req: np.ndarray | None = None  # int32 [N]: its sequence row
    verify_pos: np.ndarray | None = None  # int32 [N]: j, its place in the row's verify run
    verify_drafts: np.ndarray | None = None  # int32 [N]: the draft it checks (-1: none)
    row_map: np.ndarray | None = None  # int32 [R, K+1]: flat position of (row, j)
    num_drafts: np.ndarray | None = None  # int32 [R]
    # EAGLE: the token after each token where the host knows it (prompt, drafts; 0 else: the
    # device patches in each sampling row's last emitted token), and which rows sample.
    draft_input_ids: np.ndarray | None = None  # int32 [T]
    sample_rows: np.ndarray | None = None  # bool [R]
    # logit_bias (StepFeatures.bias = K): each row's token ids and the values added to their
    # logits; padding entries are (0, 0.0), which add nothing.
    bias_ids: np.ndarray | None = None  # int32 [R, K]
    bias_vals: np.ndarray | None = None  # float32 [R, K]
    # Custom logits processors (StepFeatures.logits_processors): each one's rows
    # [R, *row_shape] and which rows use it, bool [R].
    lp_rows: tuple | None = None
    lp_active: tuple | None = None
    # M-RoPE models (every step): each token's (temporal, row, column) rotary positions
    # int32 [3, T]; the attention and KV slots still go by `positions`.
    rope_positions: np.ndarray | None = None
    # Images (StepFeatures.mm): float32 [T, H] encoder rows, bool [T] where they replace
    # the token embedding.
    mm_embeds: np.ndarray | None = None
    mm_mask: np.ndarray | None = None

    @property
    def rotary_positions(self):
        """What the rotary embedding turns with: rope_positions where the model has them."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @property
    def mm_inputs(self):
        """(encoder rows, where they go) of a step with images, else None."""
        return None if self.mm_embeds is None else (self.mm_embeds, self.mm_mask)


def empty_step_batch(t: int, r: int, max_blocks: int, num_slots: int,
                     prompt_logprobs: bool = False, bitmask_width: int = 0,
                     num_spec: int = 0, verify: bool = False, bias: int = 0,
                     logits_processors=(), lora: bool = False, mrope: bool = False,
                     mm_width: int = 0, spans: bool = False, window: bool = False
                     ) -> StepBatch:
    """Host buffers of an all-padding (T=t, R=r) step (num_spec: K of speculative decoding,
    0 = off; verify: room for drafts; bias: logit_bias entries per row; logits_processors:
    room for their rows; lora: each token's adapter slot, -1 for none; mrope: M-RoPE
    positions; mm_width: room for image encoder rows of this width, 0 for none; spans: each
    token's bidirectional attention span, (-1, -1) for none; window: the sliding layers' own
    slot mapping and block tables)."""
    zi = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    n = min(t, r * (num_spec + 1)) if verify else r
    return StepBatch(
        input_ids=zi(t), positions=zi(t),
        attn=AttentionMetadata(slot_mapping=zi(t), block_tables=zi(r, max_blocks),
                               seq_lens=zi(r), query_start_loc=zi(r + 1), num_seqs=zi(1),
                               num_decodes=zi(1),
                               lora_slots=np.full(t, -1, np.int32) if lora else None,
                               attn_spans=np.full((t, 2), -1, np.int32) if spans else None,
                               window_slot_mapping=zi(t) if window else None,
                               window_block_tables=zi(r, max_blocks) if window else None),
        logits_indices=zi(r), token_slots=np.full(t, num_slots, np.int32),
        token_is_output=np.zeros(t, bool), req_slots=zi(r),
        reset_slots=np.full(r, num_slots, np.int32),
        sampling=SamplingMetadata(
            temperature=np.zeros(r, np.float32), top_k=zi(r), top_p=np.ones(r, np.float32),
            min_p=np.zeros(r, np.float32), repetition_penalty=np.ones(r, np.float32),
            frequency_penalty=np.zeros(r, np.float32),
            presence_penalty=np.zeros(r, np.float32), seeds=np.zeros(r, np.uint32),
            output_index=zi(r)),
        from_last_sampled=np.zeros(t, bool),
        next_token_ids=zi(t) if prompt_logprobs else None,
        bitmask=np.full((r, bitmask_width), -1, np.int32) if bitmask_width else None,
        verify_indices=zi(n) if num_spec else None,
        verify_req=zi(n) if num_spec else None,
        verify_pos=zi(n) if num_spec else None,
        verify_drafts=np.full(n, -1, np.int32) if num_spec else None,
        row_map=zi(r, num_spec + 1) if num_spec else None,
        num_drafts=zi(r) if num_spec else None,
        draft_input_ids=zi(t) if num_spec else None,
        sample_rows=np.zeros(r, bool) if num_spec else None,
        bias_ids=zi(r, bias) if bias else None,
        bias_vals=np.zeros((r, bias), np.float32) if bias else None,
        lp_rows=tuple(np.zeros((r, *p.row_shape), p.row_dtype) for p in logits_processors)
        if logits_processors else None,
        lp_active=tuple(np.zeros(r, bool) for _ in logits_processors)
        if logits_processors else None,
        rope_positions=zi(3, t) if mrope else None,
        mm_embeds=np.zeros((t, mm_width), np.float32) if mm_width else None,
        mm_mask=np.zeros(t, bool) if mm_width else None,
    )


def reset_step_batch(batch: StepBatch, num_slots: int) -> None:
    """Back to all-padding, in place (the buffers are reused step after step)."""
    for leaf in jax.tree.leaves(batch):
        leaf.fill(0)
    batch.token_slots.fill(num_slots)
    batch.reset_slots.fill(num_slots)
    batch.sampling.top_p.fill(1.0)
    batch.sampling.repetition_penalty.fill(1.0)
    if batch.verify_drafts is not None:
        batch.verify_drafts.fill(-1)
    if batch.attn.lora_slots is not None:
        batch.attn.lora_slots.fill(-1)
    if batch.attn.attn_spans is not None:
        batch.attn.attn_spans.fill(-1)


def fill_step_inputs(batch: StepBatch, token_ids: np.ndarray, block_table: np.ndarray,
                     slots: np.ndarray, computed: np.ndarray, q_lens: np.ndarray,
                     block_size: int) -> np.ndarray:
    """Flatten one step's work into `batch` (all padding on entry): sequence i (persistent
    slot slots[i]) computes q_lens[i] tokens on top of computed[i] cached ones, reading its
    tokens from token_ids[slot] and its blocks from block_table[slot]. Sequences with one query
    token must come first (attention's num_decodes). Returns each token's position [n_tok]."""
    n_req = len(slots)
    n_tok = int(q_lens.sum())
    t, r = batch.input_ids.shape[0], batch.req_slots.shape[0]
    if n_tok > t or n_req > r:
        raise ValueError(f"step of {n_tok} tokens / {n_req} sequences exceeds the bucket "
                         f"({t} tokens / {r} sequences)")
    md = batch.attn
    qsl = md.query_start_loc
    np.cumsum(q_lens, out=qsl[1 : n_req + 1])
    qsl[n_req + 1 :] = n_tok
    tok_req = np.repeat(np.arange(n_req), q_lens)  # [n_tok] sequence of each token
    tok_slot = slots[tok_req]
    pos = computed[tok_req] + (np.arange(n_tok) - qsl[tok_req])
    batch.input_ids[:n_tok] = token_ids[tok_slot, pos]
    batch.positions[:n_tok] = pos
    md.slot_mapping[:n_tok] = (block_table[tok_slot, pos // block_size] * block_size
                               + pos % block_size)
    md.block_tables[:n_req] = block_table[slots]
    md.seq_lens[:n_req] = computed + q_lens
    md.num_seqs[0] = n_req
    is_one = q_lens == 1
    md.num_decodes[0] = n_req if is_one.all() else int(np.argmin(is_one))
    batch.logits_indices[:n_req] = qsl[1 : n_req + 1] - 1
    batch.token_slots[:n_tok] = tok_slot
    batch.req_slots[:n_req] = slots
    return pos


def fill_window_inputs(batch: StepBatch, window_table: np.ndarray, slots: np.ndarray,
                       pos: np.ndarray, block_size: int) -> None:
    """The sliding layers' slot mapping and block tables (their own pool), laid out like
    fill_step_inputs' (call after it: it reads each token's slot)."""
    md, n_tok, n_req = batch.attn, len(pos), len(slots)
    tok_slot = batch.token_slots[:n_tok]
    md.window_slot_mapping[:n_tok] = (window_table[tok_slot, pos // block_size] * block_size
                                      + pos % block_size)
    md.window_block_tables[:n_req] = window_table[slots]


def fill_verify_inputs(batch: StepBatch, num_drafts: np.ndarray) -> None:
    """Speculative steps: the 1 + d_i verify positions of every sequence (the last 1 + d_i
    tokens of its query: the token sampled last, then its drafts), laid out flat; rows that
    verify nothing (a prefill chunk) still get one position. Call after fill_step_inputs (it
    reads the query layout and the input ids, where the drafts are)."""
    n_req = len(num_drafts)
    runs = num_drafts + 1
    n_flat = int(runs.sum())
    qsl = batch.attn.query_start_loc
    offsets = np.zeros(n_req + 1, np.int32)
    np.cumsum(runs, out=offsets[1:])
    req = np.repeat(np.arange(n_req, dtype=np.int32), runs)
    j = np.arange(n_flat, dtype=np.int32) - offsets[req]
    tok = qsl[req + 1] - runs[req] + j  # token index of (row, j)
    batch.verify_indices[:n_flat] = tok
    batch.verify_req[:n_flat] = req
    batch.verify_pos[:n_flat] = j
    is_draft = j < num_drafts[req]
    # Position j checks the draft at token j + 1 of the run.
    batch.verify_drafts[:n_flat] = np.where(is_draft, batch.input_ids[np.minimum(
        tok + 1, batch.input_ids.shape[0] - 1)], -1)
    k1 = batch.row_map.shape[1]
    cols = np.arange(k1)[None, :]
    batch.row_map[:n_req] = offsets[:n_req, None] + np.minimum(cols, num_drafts[:, None])
    batch.num_drafts[:n_req] = num_drafts
