"""ModelRunner: the only host<->device boundary.

Per step: apply the SchedulerOutput diff to the persistent InputBatch, build the flat padded
inputs in numpy, pick the (T, R) bucket, make ONE transfer in, run the compiled step (KV caches
and sampler state donated), make ONE transfer back of the sampled ids and logprobs.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.sampler import SamplingMetadata, sample
from jaxinfer.outputs import Logprobs, RunnerOutput, SchedulerOutput
from jaxinfer.runner.buckets import BucketTable
from jaxinfer.runner.input_batch import InputBatch
from jaxinfer.runner.kv_cache import allocate_kv_caches

MAX_LOGPROBS = 20


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
    next_token_ids: np.ndarray | None = None  # int32 [T]: next prompt token (prompt_logprobs)


def _step(graphdef, state, kv_caches, sampler_state, batch: StepBatch, *, num_logprobs: int):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(batch.input_ids, batch.positions, kv_caches, batch.attn)
    logits = model.compute_logits(hidden[batch.logits_indices])  # [R, V] float32
    counts, prompt_mask = sampler_state  # [S, V] int32, [S, V] bool
    counts = counts.at[batch.reset_slots].set(0, mode="drop")
    prompt_mask = prompt_mask.at[batch.reset_slots].set(False, mode="drop")
    is_out = batch.token_is_output
    counts = counts.at[batch.token_slots, batch.input_ids].add(is_out.astype(jnp.int32),
                                                               mode="drop")
    prompt_mask = prompt_mask.at[batch.token_slots, batch.input_ids].max(~is_out, mode="drop")
    out = sample(logits, batch.sampling, counts[batch.req_slots], prompt_mask[batch.req_slots],
                 num_logprobs=num_logprobs)
    if model.mesh is not None:  # every process can read the (small) results back
        out = jax.lax.with_sharding_constraint(out, NamedSharding(model.mesh, P()))
    if batch.next_token_ids is not None:
        # prompt_logprobs: every token's distribution over the next prompt token. [T, V]
        prompt_lp = jax.nn.log_softmax(model.compute_logits(hidden), axis=-1)
        chosen = jnp.take_along_axis(prompt_lp, batch.next_token_ids[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(prompt_lp > chosen[:, None], axis=-1).astype(jnp.int32)
        top_lp, top_ids = jax.lax.top_k(prompt_lp, num_logprobs)
        out = (out, (chosen, rank, top_ids.astype(jnp.int32), top_lp))
    return out, kv_caches, (counts, prompt_mask)


class ModelRunner:
    def __init__(self, model, *, num_kv_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, kv_dtype,
                 buckets: BucketTable | None = None):
        self.model_config = cfg = model.config
        self.mesh = model.mesh
        # Step inputs and sampler state are replicated over the mesh (None: default device).
        self._replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        self.graphdef, self.state = nnx.split(model)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.buckets = buckets or BucketTable.build(max_num_batched_tokens, max_num_seqs)
        self.kv_caches = allocate_kv_caches(cfg, num_kv_blocks, block_size, kv_dtype, self.mesh)
        self.sampler_state = (
            jnp.zeros((max_num_seqs, cfg.vocab_size), jnp.int32, device=self._replicated),
            jnp.zeros((max_num_seqs, cfg.vocab_size), bool, device=self._replicated))
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks)
        self._jitted = jax.jit(partial(_step, self.graphdef, num_logprobs=MAX_LOGPROBS),
                               donate_argnums=(1, 2))
        self._compiled: dict[tuple[int, int, bool], object] = {}
        self.num_compilations = 0
        self.compile_seconds = 0.0

    def _to_device(self, tree):
        """Host numpy pytree -> device arrays (replicated over the mesh, every process)."""
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._replicated, x), tree)

    # -- multi-host: process 0 drives, the others replay its steps ------------------------------
    @property
    def _multiprocess(self) -> bool:
        return jax.process_count() > 1

    def _broadcast_step(self, batch: StepBatch | None) -> None:
        from jax.experimental import multihost_utils

        if batch is None:  # stop
            header = np.array([0, 0, 0, 1], np.int32)
        else:
            header = np.array([batch.input_ids.shape[0], batch.req_slots.shape[0],
                               batch.next_token_ids is not None, 0], np.int32)
        multihost_utils.broadcast_one_to_all(header)
        if batch is not None:
            multihost_utils.broadcast_one_to_all(batch)

    def serve_remote_steps(self) -> None:
        """On processes > 0: run process 0's steps until it stops them."""
        from jax.experimental import multihost_utils

        while True:
            t, r, pl, stop = (int(x) for x in multihost_utils.broadcast_one_to_all(
                np.zeros(4, np.int32)))
            if stop:
                return
            batch = multihost_utils.broadcast_one_to_all(self._empty_batch(t, r, bool(pl)))
            compiled = self._compiled.get((t, r, bool(pl))) or self._compile(t, r, bool(pl))
            _, self.kv_caches, self.sampler_state = compiled(
                self.state, self.kv_caches, self.sampler_state, self._to_device(batch))

    def stop_remote_steps(self) -> None:
        if self._multiprocess and jax.process_index() == 0:
            self._broadcast_step(None)

    # -- compilation ----------------------------------------------------------------------------
    def _compile(self, t: int, r: int, prompt_logprobs: bool = False):
        t0 = time.perf_counter()
        example = self._to_device(self._empty_batch(t, r, prompt_logprobs))
        compiled = self._jitted.lower(self.state, self.kv_caches, self.sampler_state,
                                      example).compile()
        self._compiled[(t, r, prompt_logprobs)] = compiled
        self.num_compilations += 1
        self.compile_seconds += time.perf_counter() - t0
        return compiled

    def warmup(self, progress=None) -> None:
        """Compile every bucket ahead of time (results land in the persistent cache too).

        Steps that compute prompt_logprobs use a second variant, compiled on first use."""
        for t, r in self.buckets.all_pairs():
            if (t, r, False) not in self._compiled:
                self._compile(t, r)
            if progress:
                progress(t, r)

    # -- one step -------------------------------------------------------------------------------
    def _apply_diff(self, so: SchedulerOutput) -> None:
        b = self.batch
        for rid in so.finished_req_ids | so.preempted_req_ids:
            b.remove(rid)
        for new in so.scheduled_new_reqs:
            b.remove(new.req_id)  # a resumed request restarts from a clean slot
            b.add(new)
        for c in so.scheduled_cached_reqs:
            if c.new_block_ids:
                b.append_blocks(b.req_id_to_slot[c.req_id], c.new_block_ids)

    def _empty_batch(self, t: int, r: int, prompt_logprobs: bool = False) -> StepBatch:
        s = self.max_num_seqs
        zi = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return StepBatch(
            input_ids=zi(t), positions=zi(t),
            attn=AttentionMetadata(slot_mapping=zi(t), block_tables=zi(r, self.max_blocks),
                                   seq_lens=zi(r), query_start_loc=zi(r + 1), num_seqs=zi(1)),
            logits_indices=zi(r), token_slots=np.full(t, s, np.int32),
            token_is_output=np.zeros(t, bool), req_slots=zi(r),
            reset_slots=np.full(r, s, np.int32),
            sampling=SamplingMetadata(
                temperature=np.zeros(r, np.float32), top_k=zi(r), top_p=np.ones(r, np.float32),
                min_p=np.zeros(r, np.float32), repetition_penalty=np.ones(r, np.float32),
                frequency_penalty=np.zeros(r, np.float32),
                presence_penalty=np.zeros(r, np.float32), seeds=np.zeros(r, np.uint32),
                output_index=zi(r)),
            next_token_ids=zi(t) if prompt_logprobs else None,
        )

    def _build(self, so: SchedulerOutput) -> tuple[StepBatch, list[str], np.ndarray]:
        b = self.batch
        req_ids = list(so.num_scheduled_tokens)
        n_req = len(req_ids)
        slots = np.fromiter((b.req_id_to_slot[r] for r in req_ids), np.int32, n_req)
        q_lens = np.fromiter(so.num_scheduled_tokens.values(), np.int32, n_req)
        n_tok = int(q_lens.sum())
        t, r = self.buckets.pick(n_tok, n_req)
        computed = b.num_computed[slots]
        wants_pl = bool(np.any((b.num_prompt_logprobs[slots] >= 0)
                               & (computed < b.num_prompt_tokens[slots])))
        batch = self._empty_batch(t, r, wants_pl)

        qsl = batch.attn.query_start_loc
        np.cumsum(q_lens, out=qsl[1 : n_req + 1])
        qsl[n_req + 1 :] = n_tok
        tok_req = np.repeat(np.arange(n_req), q_lens)  # [n_tok] sequence of each token
        tok_slot = slots[tok_req]
        pos = computed[tok_req] + (np.arange(n_tok) - qsl[tok_req])
        batch.input_ids[:n_tok] = b.token_ids[tok_slot, pos]
        if wants_pl:
            has_next = pos + 1 < b.num_prompt_tokens[tok_slot]
            batch.next_token_ids[:n_tok] = np.where(
                has_next, b.token_ids[tok_slot, np.minimum(pos + 1, b.token_ids.shape[1] - 1)], 0)
        batch.positions[:n_tok] = pos
        batch.attn.slot_mapping[:n_tok] = (b.block_table[tok_slot, pos // self.block_size]
                                           * self.block_size + pos % self.block_size)
        batch.attn.block_tables[:n_req] = b.block_table[slots]
        batch.attn.seq_lens[:n_req] = computed + q_lens
        batch.attn.num_seqs[0] = n_req
        batch.logits_indices[:n_req] = qsl[1 : n_req + 1] - 1
        batch.token_slots[:n_tok] = tok_slot
        batch.token_is_output[:n_tok] = pos >= b.num_prompt_tokens[tok_slot]
        batch.req_slots[:n_req] = slots
        resets = b.needs_reset[slots]
        batch.reset_slots[:n_req] = np.where(resets, slots, self.max_num_seqs)
        b.needs_reset[slots] = False
        sm = batch.sampling
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            getattr(sm, name)[:n_req] = getattr(b, name)[slots]
        sm.seeds[:n_req] = b.seed[slots]
        sm.output_index[:n_req] = b.num_tokens[slots] - b.num_prompt_tokens[slots]
        b.num_computed[slots] = computed + q_lens
        self._step_spans = (computed, qsl)  # for prompt_logprobs
        return batch, req_ids, slots

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self._apply_diff(so)
        if not so.num_scheduled_tokens:
            return RunnerOutput(req_ids=(), sampled_token_ids=())
        batch, req_ids, slots = self._build(so)
        key = (batch.input_ids.shape[0], batch.req_slots.shape[0],
               batch.next_token_ids is not None)
        compiled = self._compiled.get(key) or self._compile(*key)
        if self._multiprocess:
            self._broadcast_step(batch)
        device_batch = self._to_device(batch)  # the one transfer in
        out, self.kv_caches, self.sampler_state = compiled(self.state, self.kv_caches,
                                                           self.sampler_state, device_batch)
        out = jax.device_get(out)  # the one transfer out
        prompt_lps = {}
        if batch.next_token_ids is not None:
            out, pl_out = out
            prompt_lps = self._prompt_logprobs(pl_out, batch, req_ids, slots)
        return self._to_runner_output(out, req_ids, slots, prompt_lps)

    def _prompt_logprobs(self, pl_out, batch, req_ids, slots) -> dict:
        """Per request: Logprobs of the prompt tokens this step predicted (None for token 0)."""
        chosen, rank, top_ids, top_lps = pl_out
        b = self.batch
        computed, qsl = self._step_spans
        result = {}
        for i, (rid, s) in enumerate(zip(req_ids, slots)):
            k = b.num_prompt_logprobs[s]
            n_prompt = b.num_prompt_tokens[s]
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

    def _to_runner_output(self, out, req_ids, slots, prompt_lps) -> RunnerOutput:
        b = self.batch
        sampled, logprobs = [], {}
        for i, (rid, s) in enumerate(zip(req_ids, slots)):
            if b.num_computed[s] < b.num_tokens[s]:
                sampled.append(())  # partial prefill: no token
                continue
            tok = int(out.token_ids[i])
            sampled.append((tok,))
            n = b.num_tokens[s]
            if n < b.token_ids.shape[1]:
                b.token_ids[s, n] = tok
            b.num_tokens[s] = n + 1
            k = b.num_logprobs[s]
            if k >= 0:
                logprobs[rid] = (Logprobs(
                    token_id=tok, logprob=float(out.logprob[i]), rank=int(out.rank[i]),
                    top_ids=tuple(int(x) for x in out.top_ids[i, :k]),
                    top_logprobs=tuple(float(x) for x in out.top_logprobs[i, :k])),)
        return RunnerOutput(req_ids=tuple(req_ids), sampled_token_ids=tuple(sampled),
                            logprobs=logprobs, prompt_logprobs=prompt_lps)
