"""In-step drafting for speculative decoding: a draft model or an EAGLE head runs inside the
target's compiled step (its own paged KV cache, the same block ids) and returns k drafts per
row with the sampled tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.runner.kv_cache import allocate_kv_caches
from jaxinfer.runner.step_inputs import StepBatch


class InStepDrafter:
    """A draft model ("model") or an EAGLE head ("eagle") taken apart for the step programs:
    its graph (static), its weights (StepState.draft_params) and the config of its own paged
    KV cache (as many blocks as the target's, the same block ids)."""

    def __init__(self, module, kind: str):
        self.kind = kind
        self.graphdef, self.params = nnx.split(module)
        cfg = module.config
        if kind == "eagle":
            cfg = dataclasses.replace(cfg, num_hidden_layers=module.num_kv_layers)
        self.kv_config = cfg
        # EAGLE-3 reads the residual stream entering these target layers
        self.aux_layers = tuple(getattr(module, "aux_layers", ()) or ()) if kind == "eagle" \
            else ()

    @staticmethod
    def of(draft_model=None, eagle_head=None) -> "InStepDrafter | None":
        if draft_model is not None:
            return InStepDrafter(draft_model, "model")
        if eagle_head is not None:
            return InStepDrafter(eagle_head, "eagle")
        return None

    def allocate_kv(self, num_blocks: int, block_size: int, dtype, mesh=None):
        return allocate_kv_caches(self.kv_config, num_blocks, block_size, dtype, mesh)

    def merge(self, params):
        return nnx.merge(self.graphdef, params)


def draft_propose(draft, draft_kv, input_ids, batch: StepBatch, last, num_emitted, k: int,
                  max_model_len: int):
    """The draft model's part of a speculative step: its KV for every token the target just
    computed (one forward over the same ragged batch), then k greedy single-token steps from
    each row's last emitted token, writing its KV at the k lookahead positions the scheduler
    reserved. Returns (drafts int32 [R, k], draft_kv). Rows that sampled nothing (a prefill
    chunk) draft garbage the host ignores; writes past max_model_len go to the null block."""
    md = batch.attn
    _, draft_kv = draft(input_ids, batch.positions, draft_kv, md)
    r = last.shape[0]
    block_size = draft_kv[0][0].shape[1]
    # Position of each row's last emitted token (its KV is not yet written).
    pos0 = md.seq_lens - batch.num_drafts + num_emitted - 1
    real = jnp.arange(r) < md.num_seqs[0]

    def one(j, carry):
        x, kv, drafts = carry
        p = pos0 + j
        ok = real & (p < max_model_len)
        hidden, kv = draft(x, jnp.where(ok, p, 0), kv, _lookahead_md(md, p, ok, block_size))
        nxt = jnp.argmax(draft.compute_logits(hidden), axis=-1).astype(jnp.int32)
        return nxt, kv, drafts.at[:, j].set(nxt)

    drafts = jnp.zeros((r, k), jnp.int32)
    _, draft_kv, drafts = jax.lax.fori_loop(0, k, one, (last, draft_kv, drafts))
    return drafts, draft_kv


def _lookahead_md(md: AttentionMetadata, p, ok, block_size: int) -> AttentionMetadata:
    """One query token per row at positions p (rows not ok: no write, no real context)."""
    r = p.shape[0]
    max_blocks = md.block_tables.shape[1]
    blk = jnp.take_along_axis(md.block_tables,
                              jnp.clip(p // block_size, 0, max_blocks - 1)[:, None], 1)[:, 0]
    return AttentionMetadata(slot_mapping=jnp.where(ok, blk * block_size + p % block_size, 0),
                             seq_lens=jnp.where(ok, p + 1, 1), block_tables=md.block_tables,
                             query_start_loc=jnp.arange(r + 1, dtype=jnp.int32),
                             num_seqs=md.num_seqs, num_decodes=md.num_seqs)


def eagle_propose(head, target, head_kv, target_hidden, batch: StepBatch, last, num_emitted,
                  k: int, max_model_len: int):
    """EAGLE's part of a speculative step. At each token's position the head reads the next
    token (batch.draft_input_ids; each sampling row's last accepted position gets the token
    just emitted) with the target's hidden state there: one pass over the whole step writes
    its KV and drafts the first token from each row's last accepted position; k - 1
    single-token passes continue from there on the head's own hidden state."""
    md = batch.attn
    r = last.shape[0]
    t = batch.input_ids.shape[0]
    block_size = head_kv[0][0].shape[1]
    qsl = md.query_start_loc
    # The token index of each row's last accepted position (its run start + accepted).
    at = qsl[1:] - 1 - batch.num_drafts + num_emitted - 1
    real = (jnp.arange(r) < md.num_seqs[0]) & batch.sample_rows
    ids = batch.draft_input_ids.at[jnp.where(real, at, t)].set(last, mode="drop")
    logit_h, next_h, head_kv = head(ids, batch.positions, head.combine(target_hidden), head_kv,
                                    md, target)
    at = jnp.clip(at, 0, t - 1)
    first = head.draft_ids(logit_h[at], target)
    pos = batch.positions[at]  # where each row's first draft is predicted from

    def one(j, carry):
        x, h, kv, drafts = carry
        p = pos + j
        ok = real & (p < max_model_len)
        lh, h, kv = head(x, jnp.where(ok, p, 0), h, kv, _lookahead_md(md, p, ok, block_size),
                         target)
        nxt = head.draft_ids(lh, target)
        return nxt, h, kv, drafts.at[:, j].set(nxt)

    drafts = jnp.zeros((r, k), jnp.int32).at[:, 0].set(first)
    _, _, head_kv, drafts = jax.lax.fori_loop(1, k, one, (first, next_h[at], head_kv, drafts))
    return drafts, head_kv
