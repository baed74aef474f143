"""The step math every step program shares (whole, layer-wise, pipeline stages): the step's
token ids, and the one tail after the decoder layers (LM head, grammar mask, penalties,
sampling or verification and drafting, logprobs). Pure functions traced into the programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.layers.sampler import (apply_penalties, argmax_kernel, compute_logprobs,
                                     rejection_sample, sample_tokens)
from jaxinfer.runner.spec_step import draft_propose, eagle_propose
from jaxinfer.runner.step_inputs import StepBatch, StepFeatures
from jaxinfer.runner.step_state import SamplerState
from jaxinfer.validation import MAX_LOGPROBS


def _update_penalty_state(sampler: SamplerState, input_ids, batch: StepBatch):
    """The slots' output-token counts and prompt masks with this step's tokens added (slots
    that restart cleared first)."""
    counts = sampler.counts.at[batch.reset_slots].set(0, mode="drop")
    prompt_mask = sampler.prompt_mask.at[batch.reset_slots].set(False, mode="drop")
    is_out = batch.token_is_output
    counts = counts.at[batch.token_slots, input_ids].add(is_out.astype(jnp.int32), mode="drop")
    prompt_mask = prompt_mask.at[batch.token_slots, input_ids].max(~is_out, mode="drop")
    return counts, prompt_mask


def step_input_ids(last_sampled, input_ids, from_last_sampled, token_slots):
    """The step's token ids: tokens sampled by the previous step (not yet seen by the host)
    come from the device."""
    return jnp.where(from_last_sampled, jnp.take(last_sampled, token_slots, mode="clip"),
                     input_ids)


def merge_mm_embeds(x, mm):
    """Token embeddings x [T, H] with a step's image encoder rows put in place of the
    placeholder tokens' (mm: (rows [T, H], mask [T]) or None)."""
    if mm is None:
        return x
    rows, mask = mm
    return jnp.where(mask[:, None], rows.astype(x.dtype), x)


def step_tail(model, hidden, input_ids, sampler: SamplerState, batch: StepBatch, *,
              features: StepFeatures, target_hidden=None, draft=None, draft_kind: str = "",
              draft_kv=None, max_model_len: int = 0):
    """Everything after the decoder layers, for every kind of step program: the LM head on the
    rows that sample, the grammar mask, penalties, then sampling, or (speculative decoding)
    verification of the drafts by rejection sampling and the next drafts from the draft model
    or EAGLE head; logprobs, prompt logprobs; each row's last token kept on the device.

    model: needs only its LM head (compute_logits) and mesh; hidden: the final-normed states
    [T, H]; target_hidden: what an EAGLE head reads (default hidden). Returns (outputs,
    draft_kv, sampler state)."""
    if features.pooling:  # a pooling engine: no LM head, no sampling
        return _pooling_tail(model, hidden, batch, features.pooling), draft_kv, sampler
    spec = features.spec
    # The rows the LM head computes: each sequence's last token, or (spec) its 1 + d_i
    # verify positions, each tied to its sequence row `rows`.
    rows = batch.verify_req if spec else None
    raw_logits = model.compute_logits(
        hidden[batch.verify_indices if spec else batch.logits_indices])  # float32 [R | N, V]
    if features.structured:
        # Disallowed tokens are -inf before penalties and sampling; logprobs then describe
        # the masked distribution (as vLLM's do).
        raw_logits = apply_token_bitmask(raw_logits,
                                         batch.bitmask[rows] if spec else batch.bitmask)
    logits = raw_logits
    if features.bias:  # logit_bias: added after the mask, before penalties (as in vLLM)
        ids = batch.bias_ids[rows] if spec else batch.bias_ids
        vals = batch.bias_vals[rows] if spec else batch.bias_vals
        logits = logits.at[jnp.arange(ids.shape[0])[:, None], ids].add(vals)
    for proc, p_rows, p_active in zip(features.logits_processors, batch.lp_rows or (),
                                      batch.lp_active or ()):  # custom, in batch
        if spec:
            p_rows, p_active = p_rows[rows], p_active[rows]
        logits = proc.apply(logits, p_rows, p_active)
    counts, prompt_mask = sampler.counts, sampler.prompt_mask
    if features.penalties:  # (spec: requests with penalties get no drafts, only j = 0)
        counts, prompt_mask = _update_penalty_state(sampler, input_ids, batch)
        slots = batch.req_slots[rows] if spec else batch.req_slots
        sampling = jax.tree.map(lambda x: x[rows], batch.sampling) if spec else batch.sampling
        logits = apply_penalties(logits, counts[slots], prompt_mask[slots], sampling)
    kernel = argmax_kernel(model.mesh)  # (the greedy argmax in one C++ pass per row)
    if spec:
        tokens, num_emitted = rejection_sample(logits, batch.verify_drafts, batch.sampling, rows,
                                               batch.verify_pos, batch.row_map,
                                               batch.num_drafts, kernel)
        last = jnp.take_along_axis(tokens, (num_emitted - 1)[:, None], axis=1)[:, 0]
        out = {"token_ids": tokens, "num_emitted": num_emitted}
        lp_tokens = tokens[batch.verify_req, batch.verify_pos]
    else:
        tokens = last = lp_tokens = sample_tokens(logits, batch.sampling, kernel)
        out = {"token_ids": tokens}
    # Each real sequence's last token stays on the device for the next step (padding rows
    # write nowhere).
    last_sampled = sampler.last_sampled
    real = jnp.arange(last.shape[0]) < batch.attn.num_seqs[0]
    last_sampled = last_sampled.at[jnp.where(real, batch.req_slots, last_sampled.shape[0])].set(
        last, mode="drop")
    if features.logprobs:
        out["logprobs"] = compute_logprobs(raw_logits, lp_tokens, MAX_LOGPROBS)
    if features.prompt_logprobs:
        out["prompt_logprobs"] = _prompt_logprobs(model, hidden, batch)
    if spec and draft_kind == "eagle":
        out["drafts"], draft_kv = eagle_propose(
            draft, model, draft_kv, hidden if target_hidden is None else target_hidden, batch,
            last, num_emitted, tokens.shape[1] - 1, max_model_len)
    elif spec and draft is not None:
        out["drafts"], draft_kv = draft_propose(draft, draft_kv, input_ids, batch, last,
                                                num_emitted, tokens.shape[1] - 1, max_model_len)
    if model.mesh is not None:  # every process can read the (small) results back
        out = jax.lax.with_sharding_constraint(out, NamedSharding(model.mesh, P()))
    return out, draft_kv, SamplerState(counts, prompt_mask, last_sampled)


def _pooling_tail(model, hidden, batch: StepBatch, kind: str) -> dict:
    """Each row's pooled final hidden state, float32 [R, H]: LAST its last token's, CLS its
    first token's (the host keeps it from the chunk at position 0), MEAN the sum over its
    tokens (the host adds the chunks up and divides). token_ids: a placeholder (0) that
    finishes the request (max_tokens=1) once its prompt is done."""
    r = batch.logits_indices.shape[0]
    qsl = batch.attn.query_start_loc
    if kind == "LAST":
        pooled = hidden[batch.logits_indices]
    elif kind == "CLS":
        pooled = hidden[qsl[:r]]
    else:  # MEAN: padding tokens (past the last row) map to row r and are dropped
        row = jnp.searchsorted(qsl[1:], jnp.arange(hidden.shape[0]), side="right")
        pooled = jax.ops.segment_sum(hidden.astype(jnp.float32), row, num_segments=r)
    out = {"token_ids": jnp.zeros((r,), jnp.int32), "pooled": pooled.astype(jnp.float32)}
    if model.mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(model.mesh, P()))
    return out


def _prompt_logprobs(model, hidden, batch: StepBatch):
    """Every token's distribution over the next prompt token [T, V] -> chosen, rank, top-k."""
    prompt_lp = jax.nn.log_softmax(model.compute_logits(hidden), axis=-1)
    chosen = jnp.take_along_axis(prompt_lp, batch.next_token_ids[:, None], axis=1)[:, 0]
    rank = 1 + jnp.sum(prompt_lp > chosen[:, None], axis=-1).astype(jnp.int32)
    top_lp, top_ids = jax.lax.top_k(prompt_lp, MAX_LOGPROBS)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp


def apply_token_bitmask(logits, bitmask):
    """logits [R, V]; bitmask int32 [R, W >= ceil(V/32)] -> logits with disallowed tokens -inf."""
    r, v = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(r, -1)[:, :v] != 0
    return jnp.where(allowed, logits, -jnp.inf)
