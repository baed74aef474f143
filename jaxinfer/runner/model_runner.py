"""ModelRunner: the only host<->device boundary.

Per step: apply the SchedulerOutput diff to the persistent InputBatch, build the flat padded
inputs in numpy, pick the (T, R) bucket, make ONE transfer in, run the compiled step (KV caches
and sampler state donated), make ONE transfer back of the sampled ids and logprobs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.sampler import (SamplingMetadata, apply_penalties, compute_logprobs,
                                     rejection_sample, sample_tokens)
from jaxinfer.outputs import Logprobs, RunnerOutput, SchedulerOutput
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.input_batch import InputBatch
from jaxinfer.runner.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20


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

    def __str__(self) -> str:
        on = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "+".join(on) or "plain"


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


def _update_penalty_state(counts, prompt_mask, input_ids, batch: StepBatch):
    counts = counts.at[batch.reset_slots].set(0, mode="drop")
    prompt_mask = prompt_mask.at[batch.reset_slots].set(False, mode="drop")
    is_out = batch.token_is_output
    counts = counts.at[batch.token_slots, input_ids].add(is_out.astype(jnp.int32), mode="drop")
    prompt_mask = prompt_mask.at[batch.token_slots, input_ids].max(~is_out, mode="drop")
    return counts, prompt_mask


def _step(graphdef, state, kv_caches, sampler_state, batch: StepBatch, *,
          features: StepFeatures, draft_graphdef=None, draft_kind: str = "",
          max_model_len: int = 0):
    draft = None
    if draft_graphdef is not None:  # state = (target, draft); kv_caches likewise
        (state, draft_state), (kv_caches, draft_kv) = state, kv_caches
        draft = nnx.merge(draft_graphdef, draft_state)
    model = nnx.merge(graphdef, state)
    counts, prompt_mask, last_sampled = sampler_state  # [S, V], [S, V], [S]
    # Tokens sampled by the previous step (not yet seen by the host) come from the device.
    input_ids = jnp.where(batch.from_last_sampled,
                          jnp.take(last_sampled, batch.token_slots, mode="clip"),
                          batch.input_ids)
    eagle = draft if draft_kind == "eagle" else None
    if eagle is not None and eagle.aux_layers:
        hidden, kv_caches, target_hidden = model(input_ids, batch.positions, kv_caches,
                                                 batch.attn, aux_layers=eagle.aux_layers)
    else:
        hidden, kv_caches = model(input_ids, batch.positions, kv_caches, batch.attn)
        target_hidden = hidden
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
            kv_caches = (kv_caches, draft_kv)
        elif draft is not None:
            out["drafts"], draft_kv = draft_propose(draft, draft_kv, input_ids, batch, last,
                                                    num_emitted, tokens.shape[1] - 1,
                                                    max_model_len)
            kv_caches = (kv_caches, draft_kv)
        if model.mesh is not None:
            out = jax.lax.with_sharding_constraint(out, NamedSharding(model.mesh, P()))
        return out, kv_caches, (counts, prompt_mask, last_sampled)
    out, sampler_state = _sample(model, hidden, input_ids, (counts, prompt_mask, last_sampled),
                                 batch, features)
    return out, kv_caches, sampler_state


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


def _pp_stage(graphdef, state, kv_caches, batch: StepBatch, x=None):
    """Stage s < P - 1 of a pipelined step: its layers over the residual stream (stage 0:
    from the token ids). Returns (residual stream [T, H], its KV caches)."""
    stage = nnx.merge(graphdef, state)
    return stage(batch.input_ids if x is None else x, batch.positions, kv_caches, batch.attn)


def _pp_last(graphdef, state, kv_caches, sampler_state, batch: StepBatch, x, *,
             features: StepFeatures):
    """The last stage: its layers, the final norm, the LM head and the sampler."""
    stage = nnx.merge(graphdef, state)
    hidden, kv_caches = stage(x, batch.positions, kv_caches, batch.attn)
    out, sampler_state = _sample(stage, hidden, batch.input_ids, sampler_state, batch, features)
    return out, kv_caches, sampler_state


class _PipelineLowered:
    """The lowered stage functions of one bucket and variant (this process's stages)."""

    def __init__(self, lowered: list, plan: "_PipelinePlan", shapes: dict):
        self.lowered, self.plan, self.shapes = lowered, plan, shapes

    def compile(self) -> "_PipelineCompiled":
        return _PipelineCompiled([lo.compile() if lo is not None else None
                                  for lo in self.lowered], self.plan, self.shapes)


class _PipelinePlan:
    """Where the stages run. Between two stages of this process the residual stream is
    copied device to device (jax.device_put); between stages of different processes (multi-
    host) every process takes part in one collective over a global ('pp', 'tp') mesh: a
    jax.lax.ppermute from the one stage to the next (jax.distributed's transport, gloo on
    CPU). The sampled outputs go back to process 0 the same way."""

    def __init__(self, stages, groups, targets):
        self.num = len(stages)
        self.targets = targets
        self.groups = groups
        self.meshes = [st.mesh for st in stages]
        self.owner = [groups[s][0].process_index for s in range(self.num)]
        self.local = [o == jax.process_index() for o in self.owner]
        self.multiprocess = len(set(self.owner)) > 1
        if self.multiprocess:
            from jax.sharding import Mesh

            tp = len(groups[0])
            self.pp_mesh = Mesh(np.array([d for g in groups for d in g]).reshape(self.num, tp),
                                ("pp", "tp"))
            self._shifts: dict = {}
            self._zeros: dict = {}

    def crosses(self, src: int, dst: int) -> bool:
        return self.owner[src] != self.owner[dst]

    def _shift_fn(self, src: int, dst: int):
        fn = self._shifts.get((src, dst))
        if fn is None:
            spec = P("pp")
            fn = self._shifts[(src, dst)] = jax.jit(jax.shard_map(
                lambda tree: jax.tree.map(
                    lambda g: jax.lax.ppermute(g, "pp", [(src, dst)]), tree),
                mesh=self.pp_mesh, in_specs=spec, out_specs=spec))
        return fn

    def _zero(self, shape, dtype, device):
        key = (shape, str(dtype), device.id)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = jax.device_put(np.zeros((1,) + shape, dtype), device)
        return z

    def shift(self, tree, src: int, dst: int, abstract):
        """`tree` (stage src's, on its devices; None where this process does not own it) ->
        the same values on stage dst's devices (None where this process does not own dst)."""
        sharding = NamedSharding(self.pp_mesh, P("pp"))
        stage_of = {d: s for s in range(self.num) for d in self.groups[s]}
        leaves, treedef = jax.tree.flatten(abstract)
        src_leaves = jax.tree.leaves(tree) if tree is not None else [None] * len(leaves)
        stacked = []
        for leaf, a in zip(src_leaves, leaves):
            arrays = []
            for d in sharding.addressable_devices:
                if stage_of[d] == src and leaf is not None:
                    part = next(sh.data for sh in leaf.addressable_shards if sh.device == d)
                    arrays.append(part[None])
                else:
                    arrays.append(self._zero(a.shape, a.dtype, d))
            stacked.append(jax.make_array_from_single_device_arrays(
                (self.num,) + a.shape, sharding, arrays))
        moved = self._shift_fn(src, dst)(jax.tree.unflatten(treedef, stacked))
        if not self.local[dst]:
            return None
        out = []
        for g, a in zip(jax.tree.leaves(moved), leaves):
            parts = [sh.data[0] for sh in g.addressable_shards if stage_of[sh.device] == dst]
            if self.meshes[dst] is None:
                out.append(parts[0])
            else:
                out.append(jax.make_array_from_single_device_arrays(
                    a.shape, NamedSharding(self.meshes[dst], P()), parts))
        return jax.tree.unflatten(treedef, out)

    def move(self, x, src: int, dst: int, abstract):
        if self.crosses(src, dst):
            return self.shift(x, src, dst, abstract)
        return jax.device_put(x, self.targets[dst]) if self.local[dst] else None


class _PipelineCompiled:
    """Runs a pipelined step: stage by stage (this process's stages), the residual stream
    moved between them; every call is dispatched asynchronously (nothing here waits)."""

    def __init__(self, stages: list, plan: _PipelinePlan, shapes: dict):
        self.stages, self.plan, self.shapes = stages, plan, shapes

    def __call__(self, params: list, kv: list, sampler_state, batches: list):
        plan = self.plan
        x, new_kv, out = None, [], None
        last = len(self.stages) - 1
        for s, fn in enumerate(self.stages):
            if s:  # stage s - 1 -> stage s
                x = plan.move(x, s - 1, s, self.shapes["x"][s - 1])
            if fn is None:  # another process's stage
                new_kv.append(kv[s])
                x = None
                continue
            if s < last:
                x, kv_s = fn(params[s], kv[s], batches[s]) if s == 0 else \
                    fn(params[s], kv[s], batches[s], x)
            else:
                out, kv_s, sampler_state = fn(params[s], kv[s], sampler_state, batches[s], x)
            new_kv.append(kv_s)
        if plan.crosses(last, 0):  # the outputs to process 0 (the scheduler's)
            out = plan.shift(out, last, 0, self.shapes["out"])
        return out, new_kv, sampler_state


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


def empty_step_batch(t: int, r: int, max_blocks: int, num_slots: int,
                     prompt_logprobs: bool = False, bitmask_width: int = 0,
                     num_spec: int = 0, verify: bool = False) -> StepBatch:
    """Host buffers of an all-padding (T=t, R=r) step (num_spec: K of speculative decoding,
    0 = off; verify: room for drafts)."""
    zi = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    n = min(t, r * (num_spec + 1)) if verify else r
    return StepBatch(
        input_ids=zi(t), positions=zi(t),
        attn=AttentionMetadata(slot_mapping=zi(t), block_tables=zi(r, max_blocks),
                               seq_lens=zi(r), query_start_loc=zi(r + 1), num_seqs=zi(1),
                               num_decodes=zi(1)),
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


class ModelRunner:
    def __init__(self, model, *, num_kv_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, kv_dtype,
                 buckets: BucketTable | None = None, speculative_config=None,
                 draft_model=None, eagle_head=None, stage_devices=None):
        """model: the model, or (pipeline parallelism) its list of PipelineStages, stage s on
        the devices stage_devices[s]."""
        self.stages = model if isinstance(model, list) else None
        if self.stages is not None:
            self._init_pipeline(self.stages, stage_devices)
            model = self.stages[-1]
        self.model_config = cfg = model.config
        self.mesh = model.mesh
        # Step inputs and sampler state are replicated over the mesh (None: default device).
        self._replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        if self.stages is not None:  # (the sampler state lives with the last stage)
            self._replicated = self._stage_targets[-1]
        self.graphdef, self.state = nnx.split(model)
        if self.stages is not None:
            self.graphdef = [g for g, _ in self._stage_split]
            self.state = [st for _, st in self._stage_split]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.buckets = buckets or BucketTable.build(max_num_batched_tokens, max_num_seqs)
        if self.stages is None:
            self.kv_caches = allocate_kv_caches(cfg, num_kv_blocks, block_size, kv_dtype,
                                                self.mesh)
        else:  # each stage's layers' caches on its devices (another process's: shapes)
            self.kv_caches = []
            for i, st in enumerate(self.stages):
                scfg = dataclasses.replace(cfg, num_hidden_layers=len(st.layers))
                if self._plan.local[i]:
                    self.kv_caches.append(allocate_kv_caches(
                        scfg, num_kv_blocks, block_size, kv_dtype, st.mesh,
                        device=self._stage_targets[i]))
                else:
                    shape = (num_kv_blocks, block_size, scfg.num_key_value_heads, scfg.head_dim)
                    kv = jax.ShapeDtypeStruct(shape, kv_dtype)
                    self.kv_caches.append([(kv, kv)] * scfg.num_hidden_layers)
        if self.stages is not None and not self._plan.local[-1]:  # on another process
            self.sampler_state = (
                jax.ShapeDtypeStruct((max_num_seqs, cfg.vocab_size), jnp.int32),
                jax.ShapeDtypeStruct((max_num_seqs, cfg.vocab_size), bool),
                jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32))
        else:
            self.sampler_state = (
                jnp.zeros((max_num_seqs, cfg.vocab_size), jnp.int32, device=self._replicated),
                jnp.zeros((max_num_seqs, cfg.vocab_size), bool, device=self._replicated),
                jnp.zeros((max_num_seqs,), jnp.int32, device=self._replicated))
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks)
        self.bitmask_width = (cfg.vocab_size + 31) // 32
        # Speculative decoding: K drafts at most per request; every step verifies (the spec
        # variant), and a proposer drafts from the tokens each step leaves.
        self.num_spec = speculative_config.num_speculative_tokens if speculative_config else 0
        self.base_features = StepFeatures(spec=self.num_spec > 0)
        self.proposer = None
        # A draft model runs inside the step (its own KV cache, the same block ids); its
        # drafts come back with the sampled tokens.
        self.draft_graphdef = self.draft_state = self.draft_kv = None
        self.draft_kind = ""
        self._drafts: np.ndarray | None = None  # [R, K] of the step collected last
        if draft_model is not None:
            self.draft_kind = "model"
            self.draft_graphdef, self.draft_state = nnx.split(draft_model)
            self.draft_kv = allocate_kv_caches(draft_model.config, num_kv_blocks, block_size,
                                               kv_dtype, self.mesh)
        elif eagle_head is not None:  # an EAGLE head: the same, reading the target's states
            self.draft_kind = "eagle"
            self.draft_graphdef, self.draft_state = nnx.split(eagle_head)
            self.draft_kv = allocate_kv_caches(
                dataclasses.replace(eagle_head.config, num_hidden_layers=eagle_head.num_kv_layers),
                num_kv_blocks, block_size, kv_dtype, self.mesh)
        elif speculative_config is not None:
            from jaxinfer.spec_decode.ngram import NgramProposer

            self.proposer = NgramProposer(speculative_config.prompt_lookup_min,
                                          speculative_config.prompt_lookup_max, self.num_spec)
        self._last_sampled_rows: tuple[list[str], np.ndarray] = ([], np.zeros(0, np.int32))
        # Requests whose inputs could not be prepared (request id -> error), left out of the
        # step that dispatch() launched; the engine core finishes them with that error.
        self.failed_requests: dict[str, str] = {}
        self.kv_connector = None  # a KV connector's worker side (set_kv_connector)
        self._compiled: dict[tuple[int, int, StepFeatures], object] = {}
        # Host step buffers per (T, R, prompt_logprobs, structured), two of each used in turn:
        # a buffer is refilled only after the step that read it has finished.
        self._host_buffers: dict[tuple[int, int, bool, bool], list] = {}
        # (P batches in flight under pipeline parallelism: P + 1 buffers in turn)
        self.num_host_buffers = 2 if self.stages is None else len(self.stages) + 1
        self.num_compilations = 0
        self.compile_seconds = 0.0

    def _init_pipeline(self, stages, groups) -> None:
        self._stage_targets = [NamedSharding(st.mesh, P()) if st.mesh is not None
                               else groups[i][0] for i, st in enumerate(stages)]
        self._plan = _PipelinePlan(stages, groups, self._stage_targets)
        self._stage_split = [nnx.split(st) for st in stages]

    def _to_device(self, tree):
        """Host numpy pytree -> device arrays (replicated over the mesh, every process; under
        pipeline parallelism one copy per stage, on its devices)."""
        if self.stages is not None:  # (another process's stage: the host copy, for shapes)
            return [jax.device_put(tree, target) if local else tree
                    for target, local in zip(self._stage_targets, self._plan.local)]
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._replicated, x), tree)

    # -- multi-host: process 0 drives, the others replay its steps ------------------------------
    @property
    def _multiprocess(self) -> bool:
        return jax.process_count() > 1

    def _broadcast_step(self, batch: StepBatch | None, features: StepFeatures = PLAIN) -> None:
        from jax.experimental import multihost_utils

        if batch is None:  # stop
            header = np.array([0, 0, 0, 0, 0, 0, 0, 0, 1], np.int32)
        else:
            header = np.array([batch.input_ids.shape[0], batch.req_slots.shape[0],
                               features.logprobs, features.penalties,
                               features.prompt_logprobs, features.structured, features.spec,
                               features.verify, 0], np.int32)
        multihost_utils.broadcast_one_to_all(header)
        if batch is not None:
            multihost_utils.broadcast_one_to_all(batch)

    def serve_remote_steps(self) -> None:
        """On processes > 0: run process 0's steps until it stops them."""
        from jax.experimental import multihost_utils

        while True:
            t, r, lp, pen, plp, st, sp, vf, stop = (
                int(x) for x in multihost_utils.broadcast_one_to_all(np.zeros(9, np.int32)))
            if stop:
                return
            features = StepFeatures(bool(lp), bool(pen), bool(plp), bool(st), bool(sp),
                                    bool(vf))
            batch = multihost_utils.broadcast_one_to_all(
                self._new_buffers(t, r, bool(plp), bool(st), bool(vf)))
            compiled = self._get_compiled(t, r, features)
            _, kv, self.sampler_state = compiled(
                self._params(), self._kv(), self.sampler_state, self._to_device(batch))
            self._set_kv(kv)

    def stop_remote_steps(self) -> None:
        if self._multiprocess and jax.process_index() == 0:
            self._broadcast_step(None)

    # -- compilation ----------------------------------------------------------------------------
    def _new_buffers(self, t: int, r: int, prompt_logprobs: bool,
                     structured: bool = False, verify: bool = False) -> StepBatch:
        return empty_step_batch(t, r, self.max_blocks, self.max_num_seqs, prompt_logprobs,
                                self.bitmask_width if structured else 0, self.num_spec, verify)

    def _lower(self, t: int, r: int, features: StepFeatures):
        if self.stages is not None:
            return self._lower_pipeline(t, r, features)
        example = self._to_device(self._new_buffers(t, r, features.prompt_logprobs,
                                                    features.structured, features.verify))
        jitted = jax.jit(partial(_step, self.graphdef, features=features,
                                 draft_graphdef=self.draft_graphdef,
                                 draft_kind=self.draft_kind, max_model_len=self.max_model_len),
                         donate_argnums=(1, 2))
        return jitted.lower(self._params(), self._kv(), self.sampler_state, example)

    def _lower_pipeline(self, t: int, r: int, features: StepFeatures) -> _PipelineLowered:
        if features.spec:
            raise ValueError("speculative decoding is not supported with pipeline parallelism")
        host = self._new_buffers(t, r, features.prompt_logprobs, features.structured,
                                 features.verify)
        examples = self._to_device(host)
        plan, lowered, x = self._plan, [], None
        shapes = {"x": []}
        last = len(self.stages) - 1
        for s, (graphdef, state) in enumerate(zip(self.graphdef, self.state)):
            if s:  # the residual stream of the previous stage, on this stage's devices
                target = self._stage_targets[s]
                if not isinstance(target, jax.sharding.Sharding):
                    target = jax.sharding.SingleDeviceSharding(target)
                prev = shapes["x"][-1]
                x = jax.ShapeDtypeStruct(prev.shape, prev.dtype, sharding=target)
            if s < last:
                fn = jax.jit(partial(_pp_stage, graphdef), donate_argnums=(1,))
                args = (state, self.kv_caches[s], examples[s]) + (() if s == 0 else (x,))
            else:
                fn = jax.jit(partial(_pp_last, graphdef, features=features),
                             donate_argnums=(1, 2))
                args = (state, self.kv_caches[s], self.sampler_state, examples[s], x)
            if plan.local[s]:
                lowered.append(fn.lower(*args))
                info = lowered[-1].out_info
            else:  # another process's stage: its output shapes only
                lowered.append(None)
                info = jax.eval_shape(fn, *args)
            if s < last:
                shapes["x"].append(info[0])
            else:
                shapes["out"] = info[0]
        return _PipelineLowered(lowered, plan, shapes)

    def _params(self):
        return self.state if self.draft_graphdef is None else (self.state, self.draft_state)

    def _kv(self):
        return self.kv_caches if self.draft_graphdef is None else (self.kv_caches, self.draft_kv)

    def _set_kv(self, kv) -> None:
        if self.draft_graphdef is None:
            self.kv_caches = kv
        else:
            self.kv_caches, self.draft_kv = kv

    def _compile(self, t: int, r: int, features: StepFeatures = PLAIN):
        t0 = time.perf_counter()
        compiled = self._lower(t, r, features).compile()
        self._add_compiled((t, r, features), compiled, time.perf_counter() - t0)
        return compiled

    def _add_compiled(self, key, compiled, seconds: float) -> None:
        self._compiled[key] = compiled
        self.num_compilations += 1
        self.compile_seconds += seconds

    def _get_compiled(self, t: int, r: int, features: StepFeatures):
        compiled = self._compiled.get((t, r, features))
        if compiled is None:
            if dataclasses.replace(features, verify=False) != self.base_features:
                logger.info("compiling step variant T=%d R=%d %s on first use", t, r, features)
            compiled = self._compile(t, r, features)
        return compiled

    def warmup(self, progress=None, num_threads: int | None = None) -> None:
        """Compile every bucket of the plain variant ahead of time (into the persistent cache
        too). Variants with logprobs / penalties / prompt_logprobs compile on first use (with a
        log line): all of them at every bucket would multiply the start-up time by eight.

        Buckets are traced and lowered here, one after another (Python), and compiled by
        `num_threads` threads (default: one per CPU core, at most 4): XLA compiles outside the
        GIL, so on a 2-core machine start-up takes about half the time."""
        from concurrent.futures import ThreadPoolExecutor

        bases = [self.base_features]
        if self.num_spec:  # steps with drafts to verify, and steps without
            bases.append(dataclasses.replace(self.base_features, verify=True))
        todo = [(t, r, f) for f in bases for t, r in self.buckets.all_pairs()
                if (t, r, f) not in self._compiled]
        n = num_threads or min(os.cpu_count() or 1, 4)
        if n <= 1 or self._multiprocess:
            for t, r, f in todo:
                self._compile(t, r, f)
                if progress:
                    progress(t, r)
            return

        def compile_one(lowered):
            t0 = time.perf_counter()
            return lowered.compile(), time.perf_counter() - t0

        with ThreadPoolExecutor(n, thread_name_prefix="jaxinfer-compile") as pool:
            futures = [((t, r, f), pool.submit(compile_one, self._lower(t, r, f)))
                       for t, r, f in todo]
            for (t, r, f), fut in futures:
                compiled, seconds = fut.result()
                self._add_compiled((t, r, f), compiled, seconds)
                if progress:
                    progress(t, r)

    # -- one step -------------------------------------------------------------------------------
    def _apply_diff(self, so: SchedulerOutput) -> dict[str, str]:
        """Returns the new requests that could not be taken in (request id -> error): one
        request whose values do not fit its slot fails alone."""
        b = self.batch
        for rid in so.finished_req_ids | so.preempted_req_ids:
            b.remove(rid)
        failed = {}
        for new in so.scheduled_new_reqs:
            b.remove(new.req_id)  # a resumed request restarts from a clean slot
            try:
                b.add(new)
            except Exception as e:  # noqa: BLE001 - that request fails, the step goes on
                logger.exception("preparing the inputs of request %s failed", new.req_id)
                b.remove(new.req_id)
                failed[new.req_id] = (f"engine error while preparing the request's inputs: "
                                      f"{type(e).__name__}: {e}")
        for c in so.scheduled_cached_reqs:
            if c.new_block_ids:
                b.append_blocks(b.req_id_to_slot[c.req_id], c.new_block_ids)
        return failed

    def _buffers(self, t: int, r: int, prompt_logprobs: bool, structured: bool,
                 verify: bool = False) -> StepBatch:
        key = (t, r, prompt_logprobs, structured, verify)
        pair = self._host_buffers.get(key)
        if pair is None:
            pair = self._host_buffers[key] = [self._new_buffers(*key)
                                              for _ in range(self.num_host_buffers)]
        pair.append(pair.pop(0))  # the one used longest ago
        batch = pair[0]
        reset_step_batch(batch, self.max_num_seqs)
        return batch

    def _build(self, so: SchedulerOutput, grammar=None):
        b = self.batch
        sched = so.num_scheduled_tokens
        n_req = len(sched)
        q_lens = np.fromiter(sched.values(), np.int32, n_req)
        req_ids = list(sched)
        is_one = q_lens == 1
        if not is_one[: int(is_one.sum())].all():
            # Single-token sequences first: the xla attention batches them (num_decodes).
            order = np.argsort(q_lens != 1, kind="stable")
            q_lens = q_lens[order]
            req_ids = [req_ids[i] for i in order]
        slots = np.fromiter((b.req_id_to_slot[r] for r in req_ids), np.int32, n_req)
        n_tok = int(q_lens.sum())
        t, r = self.buckets.pick(n_tok, n_req)
        computed = b.num_computed[slots]
        wants_pl = bool(np.any((b.num_prompt_logprobs[slots] >= 0)
                               & (computed < b.num_prompt_tokens[slots])))
        penalties = bool(np.any((b.repetition_penalty[slots] != 1.0)
                                | (b.frequency_penalty[slots] != 0.0)
                                | (b.presence_penalty[slots] != 0.0)))
        structured = grammar is not None
        spec = so.scheduled_spec_decode_tokens
        verify = bool(self.num_spec and spec and any(rid in spec for rid in req_ids))
        features = StepFeatures(logprobs=bool(np.any(b.num_logprobs[slots] >= 0)),
                                penalties=penalties, prompt_logprobs=wants_pl,
                                structured=structured, spec=self.num_spec > 0, verify=verify)
        batch = self._buffers(t, r, wants_pl, structured, verify)
        num_drafts = None
        if self.num_spec:
            num_drafts = np.zeros(n_req, np.int32)
            if spec:
                for i, rid in enumerate(req_ids):
                    drafts = spec.get(rid)
                    if drafts:
                        s, n0 = slots[i], b.num_tokens[slots[i]]
                        b.token_ids[s, n0 : n0 + len(drafts)] = drafts  # tokens to verify
                        num_drafts[i] = len(drafts)
        if structured:
            grammar_ids, grammar_bitmask = grammar
            row_of = {rid: i for i, rid in enumerate(req_ids)}
            batch.bitmask.fill(-1)
            batch.bitmask[[row_of[rid] for rid in grammar_ids]] = grammar_bitmask
        pos = fill_step_inputs(batch, b.token_ids, b.block_table, slots, computed, q_lens,
                               self.block_size)
        if num_drafts is not None:
            fill_verify_inputs(batch, num_drafts)
            batch.sample_rows[:n_req] = computed + q_lens >= b.num_tokens[slots]
            if self.draft_kind == "eagle":  # the token after each one, where known
                row = np.repeat(np.arange(n_req), q_lens)
                nxt = pos + 1
                known = nxt < (b.num_tokens[slots] + num_drafts)[row]
                batch.draft_input_ids[:n_tok] = np.where(
                    known, b.token_ids[slots[row], np.minimum(nxt, b.token_ids.shape[1] - 1)], 0)
        tok_slot = batch.token_slots[:n_tok]
        if wants_pl:
            has_next = pos + 1 < b.num_prompt_tokens[tok_slot]
            batch.next_token_ids[:n_tok] = np.where(
                has_next, b.token_ids[tok_slot, np.minimum(pos + 1, b.token_ids.shape[1] - 1)], 0)
        if penalties:
            batch.token_is_output[:n_tok] = pos >= b.num_prompt_tokens[tok_slot]
            resets = b.needs_reset[slots]
            batch.reset_slots[:n_req] = np.where(resets, slots, self.max_num_seqs)
        b.needs_reset[slots] = False  # penalty state matters only to steps that use it
        sm = batch.sampling
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            getattr(sm, name)[:n_req] = getattr(b, name)[slots]
        sm.seeds[:n_req] = b.seed[slots]
        sm.output_index[:n_req] = b.num_tokens[slots] - b.num_prompt_tokens[slots]
        # The token sampled by the step in flight (async scheduling) is read on the device.
        batch.from_last_sampled[:n_tok] = ((b.pending[tok_slot] > 0)
                                           & (pos == b.num_tokens[tok_slot] - 1))
        b.num_computed[slots] = computed + q_lens
        return batch, features, req_ids, slots, computed, num_drafts

    def dispatch(self, so: SchedulerOutput, grammar=None) -> "_InFlightStep | None":
        """Apply the diff, build the inputs and launch the step; does not wait for it. The
        rows that sample a real token count it at once (InputBatch.num_tokens / pending), so
        the next step can be built before this one is collected. None: nothing to run."""
        if so.scheduled_spec_decode_tokens and not self.num_spec:
            raise ValueError("draft tokens were scheduled, but speculative decoding is off")
        if self.kv_connector is not None and so.kv_connector_metadata:
            # Loads, saves and cancels start before the step: a gather is enqueued before
            # the step can overwrite its blocks.
            self.kv_connector.bind_connector_metadata(so.kv_connector_metadata)
        failed = self._apply_diff(so)
        if failed:
            self.failed_requests.update(failed)
            so, grammar = _without_requests(so, grammar, failed)
        if not so.num_scheduled_tokens:
            return None
        batch, features, req_ids, slots, computed, num_drafts = self._build(so, grammar)
        t, r = batch.input_ids.shape[0], batch.req_slots.shape[0]
        compiled = self._get_compiled(t, r, features)
        if self._multiprocess:
            self._broadcast_step(batch, features)
        device_batch = self._to_device(batch)  # the one transfer in
        out, kv, self.sampler_state = compiled(self._params(), self._kv(), self.sampler_state,
                                               device_batch)
        self._set_kv(kv)
        b = self.batch
        samples = b.num_computed[slots] >= b.num_tokens[slots]  # else a partial prefill
        positions = b.num_tokens[slots].copy()  # where each sampled token goes
        b.num_tokens[slots] += samples
        b.pending[slots] += samples
        return _InFlightStep(out, batch, req_ids, slots, computed, samples, positions,
                             b.num_logprobs[slots], b.num_prompt_logprobs[slots],
                             b.num_prompt_tokens[slots], num_drafts)

    def collect(self, step: "_InFlightStep | None") -> RunnerOutput:
        """Wait for a dispatched step and read its results back (the one transfer out)."""
        if step is None:
            return RunnerOutput(req_ids=(), sampled_token_ids=())
        out = jax.device_get(step.out)
        b = self.batch
        tokens = out["token_ids"]
        if "num_emitted" in out:
            self._collect_spec(out, step)
        else:
            for i, (rid, s) in enumerate(zip(step.req_ids, step.slots)):
                # The slot may have been freed (finished) or re-used since the dispatch.
                if step.samples[i] and b.req_id_to_slot.get(rid) == s:
                    n = step.positions[i]
                    if n < b.token_ids.shape[1]:
                        b.token_ids[s, n] = tokens[i]
                    b.pending[s] -= 1
        prompt_lps = {}
        if "prompt_logprobs" in out:
            prompt_lps = self._prompt_logprobs(out["prompt_logprobs"], step)
        return self._to_runner_output(out, step, prompt_lps)

    def _collect_spec(self, out, step: "_InFlightStep") -> None:
        """Write each row's emitted tokens (accepted drafts + one) and roll its computed
        tokens back by the rejected drafts (their KV is garbage, recomputed later)."""
        b = self.batch
        tokens, emitted = out["token_ids"], out["num_emitted"]
        rows, slots = [], []
        for i, (rid, s) in enumerate(zip(step.req_ids, step.slots)):
            if not step.samples[i] or b.req_id_to_slot.get(rid) != s:
                continue
            e = int(emitted[i])
            n = step.positions[i]
            m = min(e, b.token_ids.shape[1] - n)
            b.token_ids[s, n : n + m] = tokens[i, :m]
            b.num_tokens[s] += e - 1
            b.num_computed[s] -= int(step.num_drafts[i]) - (e - 1)
            b.pending[s] -= 1
            rows.append(rid)
            slots.append(s)
        self._last_sampled_rows = (rows, np.array(slots, np.int32))
        if "drafts" in out:
            index = {rid: i for i, rid in enumerate(step.req_ids)}
            self._drafts = out["drafts"][[index[r] for r in rows]]

    def take_failed_requests(self) -> dict[str, str]:
        failed, self.failed_requests = self.failed_requests, {}
        return failed

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """Drafts for the requests that sampled in the step collected last (speculative
        decoding; empty when off). The scheduler filters and caps them."""
        rows, slots = self._last_sampled_rows
        self._last_sampled_rows = ([], np.zeros(0, np.int32))
        if self._drafts is not None:  # from the draft model, in the step itself
            drafts, self._drafts = self._drafts, None
            return {rid: d.tolist() for rid, d in zip(rows, drafts)}
        if self.proposer is None or not rows:
            return {}
        b = self.batch  # (the scheduler decides which requests may take drafts)
        try:
            drafts = self.proposer.propose(b.token_ids, slots, b.num_tokens[slots])
        except Exception:  # noqa: BLE001 - drafts are optional: this step goes without
            logger.exception("the n-gram proposer failed; no drafts this step")
            return {}
        return {rid: d for rid, d in zip(rows, drafts) if d}

    def set_kv_connector(self, worker) -> None:
        """Attach a KV connector's worker side: it reaches the cache only through a
        KVBlockIO (compiled gathers and scatters of whole blocks)."""
        from jaxinfer.runner.kv_block_io import KVBlockIO

        self.kv_connector = worker
        worker.register_block_io(KVBlockIO(self))

    def get_kv_connector_output(self):
        """Poll the connector: scatter loads that arrived into the cache (before any later
        step), report loads done or failed and blocks sent. None without a connector."""
        return None if self.kv_connector is None else self.kv_connector.get_finished()

    def execute(self, so: SchedulerOutput, grammar=None) -> RunnerOutput:
        """grammar: (request ids, int32 bitmask [n, ceil(V/32)]) of the rows sampling under a
        grammar (Scheduler.get_grammar_bitmask), or None."""
        return self.collect(self.dispatch(so, grammar))

    def _prompt_logprobs(self, pl_out, step: "_InFlightStep") -> dict:
        """Per request: Logprobs of the prompt tokens this step predicted (None for token 0)."""
        chosen, rank, top_ids, top_lps = pl_out
        batch = step.batch
        computed, qsl = step.computed, batch.attn.query_start_loc
        result = {}
        for i, rid in enumerate(step.req_ids):
            k = step.num_prompt_logprobs[i]
            n_prompt = step.num_prompt_tokens[i]
            if k < 0 or computed[i] >= n_prompt:
                continue
            entries = [None] if computed[i] == 0 else []
            for j in range(qsl[i], qsl[i + 1]):
                pos = computed[i] + (j - qsl[i])
                if pos + 1 >= n_prompt:
                    break
                entries.append(Logprobs(
                    token_id=int(batch.next_token_ids[j]), logprob=float(chosen[j]),
                    rank=int(rank[j]), top_ids=tuple(int(x) for x in top_ids[j, :k]),
                    top_logprobs=tuple(float(x) for x in top_lps[j, :k])))
            result[rid] = tuple(entries)
        return result

    def _to_runner_output(self, out, step: "_InFlightStep", prompt_lps) -> RunnerOutput:
        sampled, logprobs = [], {}
        token_ids = out["token_ids"].tolist()
        emitted = out.get("num_emitted")
        row_map = step.batch.row_map
        lp = out.get("logprobs")
        for i, rid in enumerate(step.req_ids):
            if not step.samples[i]:
                sampled.append(())  # partial prefill: no token
                continue
            if emitted is None:
                toks, flat = (token_ids[i],), (i,)
            else:
                e = int(emitted[i])
                toks, flat = tuple(token_ids[i][:e]), row_map[i, :e]
            sampled.append(toks)
            k = step.num_logprobs[i]
            if k >= 0:
                logprobs[rid] = tuple(Logprobs(
                    token_id=tok, logprob=float(lp.logprob[f]), rank=int(lp.rank[f]),
                    top_ids=tuple(int(x) for x in lp.top_ids[f, :k]),
                    top_logprobs=tuple(float(x) for x in lp.top_logprobs[f, :k]))
                    for tok, f in zip(toks, flat))
        return RunnerOutput(req_ids=tuple(step.req_ids), sampled_token_ids=tuple(sampled),
                            logprobs=logprobs, prompt_logprobs=prompt_lps)


def _without_requests(so: SchedulerOutput, grammar, ids) -> tuple[SchedulerOutput, Any]:
    """The step without the requests `ids` (and their grammar bitmask rows)."""
    keep = {r: n for r, n in so.num_scheduled_tokens.items() if r not in ids}
    so = dataclasses.replace(
        so, scheduled_new_reqs=tuple(n for n in so.scheduled_new_reqs if n.req_id not in ids),
        scheduled_cached_reqs=tuple(c for c in so.scheduled_cached_reqs
                                    if c.req_id not in ids),
        num_scheduled_tokens=keep, total_num_scheduled_tokens=sum(keep.values()),
        scheduled_spec_decode_tokens={r: d for r, d in so.scheduled_spec_decode_tokens.items()
                                      if r not in ids})
    if grammar is not None:
        grammar_ids, bitmask = grammar
        rows = [i for i, r in enumerate(grammar_ids) if r not in ids]
        grammar = ([grammar_ids[i] for i in rows], bitmask[rows]) if rows else None
    return so, grammar


@dataclasses.dataclass
class _InFlightStep:
    """A dispatched step: its device outputs and what collect() needs to read them."""

    out: dict  # device arrays: token_ids [R] (+ logprobs, prompt_logprobs)
    batch: StepBatch  # the host inputs (its buffer is not refilled before collect)
    req_ids: list[str]  # in row order
    slots: np.ndarray  # int32 [n_req] persistent slot per row
    computed: np.ndarray  # int32 [n_req] tokens computed before the step
    samples: np.ndarray  # bool [n_req] the row samples a real token (not a partial prefill)
    positions: np.ndarray  # int32 [n_req] the sampled token's position in the sequence
    # Per row, as at dispatch (the request may leave the batch before collect):
    num_logprobs: np.ndarray  # int32 [n_req] -1: none wanted
    num_prompt_logprobs: np.ndarray  # int32 [n_req] -1: none wanted
    num_prompt_tokens: np.ndarray  # int32 [n_req]
    num_drafts: np.ndarray | None = None  # int32 [n_req] drafts verified (spec decoding)
