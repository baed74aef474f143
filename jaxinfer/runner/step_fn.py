"""The jitted step math: the forward pass, then the LM head, grammar mask, penalties and
sampling on the sampling rows (or, with speculative decoding, verification of the drafts by
rejection sampling and the next drafts), prompt logprobs; and the per-stage functions of a
pipelined step. Pure functions of (weights, KV caches, sampler state, StepBatch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.layers.sampler import (apply_penalties, compute_logprobs, rejection_sample,
                                     sample_tokens)
from jaxinfer.runner.spec_step import draft_propose, eagle_propose
from jaxinfer.runner.step_inputs import StepBatch, StepFeatures
from jaxinfer.validation import MAX_LOGPROBS


def _spec_step(model, hidden, input_ids, counts, prompt_mask, batch: StepBatch,
               features: StepFeatures):
    """Logits at every verify position, then rejection sampling. Returns (tokens [R, K+1],
    num_emitted [R], raw logits [N, V], counts, prompt_mask)."""
    rows = batch.verify_req
    raw_logits = model.compute_logits(hidden[batch.verify_indices])  # [N, V] float32
    if features.structured:
        raw_logits = apply_token_bitmask(raw_logits, batch.bitmask[rows])
    logits = raw_logits
    if features.penalties:  # (requests with penalties get no drafts: only j = 0 is theirs)
        counts, prompt_mask = _update_penalty_state(counts, prompt_mask, input_ids, batch)
        slots = batch.req_slots[rows]
        logits = apply_penalties(logits, counts[slots], prompt_mask[slots],
                                 jax.tree.map(lambda x: x[rows], batch.sampling))
    tokens, num_emitted = rejection_sample(logits, batch.verify_drafts, batch.sampling, rows,
                                           batch.verify_pos, batch.row_map, batch.num_drafts)
    return tokens, num_emitted, raw_logits, counts, prompt_mask


def _update_penalty_state(counts, prompt_mask, input_ids, batch: StepBatch):
    counts = counts.at[batch.reset_slots].set(0, mode="drop")
    prompt_mask = prompt_mask.at[batch.reset_slots].set(False, mode="drop")
    is_out = batch.token_is_output
    counts = counts.at[batch.token_slots, input_ids].add(is_out.astype(jnp.int32), mode="drop")
    prompt_mask = prompt_mask.at[batch.token_slots, input_ids].max(~is_out, mode="drop")
    return counts, prompt_mask


def step_input_ids(last_sampled, input_ids, from_last_sampled, token_slots):
    """The step's token ids: tokens sampled by the previous step (not yet seen by the host)
    come from the device."""
    return jnp.where(from_last_sampled, jnp.take(last_sampled, token_slots, mode="clip"),
                     input_ids)


def model_step(graphdef, state, kv_caches, sampler_state, batch: StepBatch, *,
               features: StepFeatures, draft_graphdef=None, draft_kind: str = "",
               max_model_len: int = 0):
    """One whole step as one compiled program: the forward over every layer, then the tail."""
    draft = draft_kv = None
    if draft_graphdef is not None:  # state = (target, draft); kv_caches likewise
        (state, draft_state), (kv_caches, draft_kv) = state, kv_caches
        draft = nnx.merge(draft_graphdef, draft_state)
    model = nnx.merge(graphdef, state)
    input_ids = step_input_ids(sampler_state[2], batch.input_ids, batch.from_last_sampled,
                               batch.token_slots)
    eagle = draft if draft_kind == "eagle" else None
    if eagle is not None and eagle.aux_layers:
        hidden, kv_caches, target_hidden = model(input_ids, batch.positions, kv_caches,
                                                 batch.attn, aux_layers=eagle.aux_layers)
    else:
        hidden, kv_caches = model(input_ids, batch.positions, kv_caches, batch.attn)
        target_hidden = hidden
    out, draft_kv, sampler_state = step_tail(
        model, hidden, target_hidden, input_ids, sampler_state, batch, features=features,
        draft=draft, draft_kind=draft_kind, draft_kv=draft_kv, max_model_len=max_model_len)
    return out, (kv_caches if draft is None else (kv_caches, draft_kv)), sampler_state


def step_tail(model, hidden, target_hidden, input_ids, sampler_state, batch: StepBatch, *,
              features: StepFeatures, draft=None, draft_kind: str = "", draft_kv=None,
              max_model_len: int = 0):
    """Everything after the decoder layers: the LM head, grammar mask, penalties and
    sampling (or verification and the next drafts). hidden: the final-normed states [T, H];
    target_hidden: what an EAGLE head reads (hidden, or the aux layers' states). `model` needs
    only its embedding, final norm and LM head. Returns (outputs, draft_kv, sampler_state)."""
    counts, prompt_mask, last_sampled = sampler_state  # [S, V], [S, V], [S]
    eagle = draft if draft_kind == "eagle" else None
    if features.spec:
        tokens, num_emitted, raw_logits, counts, prompt_mask = _spec_step(
            model, hidden, input_ids, counts, prompt_mask, batch, features)
        last = jnp.take_along_axis(tokens, (num_emitted - 1)[:, None], axis=1)[:, 0]
        num_slots = last_sampled.shape[0]
        rows = jnp.arange(last.shape[0])
        write_slots = jnp.where(rows < batch.attn.num_seqs[0], batch.req_slots, num_slots)
        last_sampled = last_sampled.at[write_slots].set(last, mode="drop")
        out = {"token_ids": tokens, "num_emitted": num_emitted}
        if features.logprobs:
            flat = tokens[batch.verify_req, batch.verify_pos]
            out["logprobs"] = compute_logprobs(raw_logits, flat, MAX_LOGPROBS)
        if features.prompt_logprobs:
            out["prompt_logprobs"] = _prompt_logprobs(model, hidden, batch)
        if eagle is not None:
            out["drafts"], draft_kv = eagle_propose(eagle, model, draft_kv, target_hidden,
                                                    batch, last, num_emitted,
                                                    tokens.shape[1] - 1, max_model_len)
        elif draft is not None:
            out["drafts"], draft_kv = draft_propose(draft, draft_kv, input_ids, batch, last,
                                                    num_emitted, tokens.shape[1] - 1,
                                                    max_model_len)
        if model.mesh is not None:
            out = jax.lax.with_sharding_constraint(out, NamedSharding(model.mesh, P()))
        return out, draft_kv, (counts, prompt_mask, last_sampled)
    out, sampler_state = _sample(model, hidden, input_ids, (counts, prompt_mask, last_sampled),
                                 batch, features)
    return out, draft_kv, sampler_state


def _sample(model, hidden, input_ids, sampler_state, batch: StepBatch, features: StepFeatures):
    """The LM head, penalties, grammar mask and sampler of a plain (non-speculative) step, on
    the R sampling rows only (never on all T tokens). Returns (outputs, sampler_state)."""
    counts, prompt_mask, last_sampled = sampler_state
    raw_logits = model.compute_logits(hidden[batch.logits_indices])  # [R, V] float32
    if features.structured:
        # Disallowed tokens are -inf before penalties and sampling; logprobs then describe
        # the masked distribution (as vLLM's do).
        raw_logits = apply_token_bitmask(raw_logits, batch.bitmask)
    logits = raw_logits
    if features.penalties:
        counts, prompt_mask = _update_penalty_state(counts, prompt_mask, input_ids, batch)
        logits = apply_penalties(logits, counts[batch.req_slots], prompt_mask[batch.req_slots],
                                 batch.sampling)
    token_ids = sample_tokens(logits, batch.sampling)
    # Each real sequence's sampled id stays on the device for the next step (padding rows
    # write nowhere).
    num_slots = last_sampled.shape[0]
    rows = jnp.arange(token_ids.shape[0])
    write_slots = jnp.where(rows < batch.attn.num_seqs[0], batch.req_slots, num_slots)
    last_sampled = last_sampled.at[write_slots].set(token_ids, mode="drop")
    sampler_state = (counts, prompt_mask, last_sampled)
    out = {"token_ids": token_ids}
    if features.logprobs:
        out["logprobs"] = compute_logprobs(raw_logits, token_ids, MAX_LOGPROBS)
    if features.prompt_logprobs:
        out["prompt_logprobs"] = _prompt_logprobs(model, hidden, batch)
    if model.mesh is not None:  # every process can read the (small) results back
        out = jax.lax.with_sharding_constraint(out, NamedSharding(model.mesh, P()))
    return out, sampler_state


def pp_stage(graphdef, state, kv_caches, batch: StepBatch, x=None):
    """Stage s < P - 1 of a pipelined step: its layers over the residual stream (stage 0:
    from the token ids). Returns (residual stream [T, H], its KV caches)."""
    stage = nnx.merge(graphdef, state)
    return stage(batch.input_ids if x is None else x, batch.positions, kv_caches, batch.attn)


def pp_last(graphdef, state, kv_caches, sampler_state, batch: StepBatch, x, *,
             features: StepFeatures):
    """The last stage: its layers, the final norm, the LM head and the sampler."""
    stage = nnx.merge(graphdef, state)
    hidden, kv_caches = stage(x, batch.positions, kv_caches, batch.attn)
    out, sampler_state = _sample(stage, hidden, batch.input_ids, sampler_state, batch, features)
    return out, kv_caches, sampler_state


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
