"""Layer-wise steps: compile cost independent of depth.

A "whole" step is one XLA program with every decoder layer unrolled in it, so compiling a
bucket costs about (layers x one layer) + the rest: ~4.4 s per bucket for SmolLM2's 30 layers
on the 2-core CPU, and ~53 buckets. A layer-wise step is three kinds of compiled program per
bucket instead, each traced and compiled once:

- head: the step's token ids (patched with the previous step's samples) -> embeddings and the
  rotary cos/sin;
- runs of `group` consecutive decoder layers (layers_per_program, default 5) over the
  residual stream and their own KV caches (donated); one executable runs every run of the
  same structure in turn, with that run's weights, and every variant of the bucket
  (logprobs, penalties, ... change only the tail) shares it;
- tail: the final norm and step_fn.step_tail (LM head, sampling or verification, in-step
  drafting with a draft model or EAGLE head, which stay whole: they are small).

So compiling a bucket costs one run + the tail whatever the depth (SmolLM2: ~1.4 s). The price
is L / group + 2 dispatches per step instead of one, each asynchronous: with today's CPU
kernels whole steps lead layer-wise ones by 5-15% in steady state (docs/cpu.md says what is
known of why); one layer per program measured ~5% slower per step than runs of 3, runs of 5
and 10 3-4% faster than 3 at the same cold start (results/layers_per_program_cpu.json), so 5
is the default (EngineConfig.layers_per_program). The host keeps the per-layer
weights and KV caches it always had: loading, tensor-parallel shardings and the KV connectors
are unchanged. Under tensor parallelism the residual stream between runs is pinned replicated
so every executable sees the sharding it was compiled for.
"""

from __future__ import annotations

import threading
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.layers import module_list
from jaxinfer.runner.compiled_steps import TRACE_LOCK
from jaxinfer.runner.spec_step import InStepDrafter
from jaxinfer.runner.step_fn import merge_mm_embeds, step_input_ids, step_tail
from jaxinfer.runner.step_inputs import StepBatch, StepFeatures
from jaxinfer.runner.step_state import StepState, place_replicated, single_stage_state
from jaxinfer.runner.transfer import PackedBatch, device_batch, step_input


def layer_runs(num_layers: int, group: int, cuts=()) -> list[tuple[int, int]]:
    """Runs [a, b) of consecutive layers, at most `group` long, a new one at every cut."""
    runs, a = [], 0
    for i in range(1, num_layers + 1):
        if i == num_layers or i - a == group or i in cuts:
            runs.append((a, i))
            a = i
    return runs


class LayerwiseModel:
    """A model taken apart for layer-wise steps: the shell (embedding, final norm, LM head: the
    model with no layers), each layer's flat parameter leaves, and the layers cut into runs of
    `group` consecutive layers (a new run also starts at each aux layer, whose input EAGLE-3
    reads). Runs whose layers have the same structures share one executable (a "kind")."""

    def __init__(self, model, group: int, aux_layers: tuple[int, ...] = (),
                 container=None):
        """container: what holds `.layers` (default model.model; a pipeline stage itself)."""
        if group < 1:
            raise ValueError(f"layers_per_program must be >= 1, got {group}")
        container = model.model if container is None else container
        layers = list(container.layers)
        container.layers = module_list([])
        try:
            self.shell_graphdef, self.shell_state = nnx.split(model)
        finally:
            container.layers = module_list(layers)
        self.mesh = model.mesh
        self.num_layers = len(layers)
        graphdefs, treedefs, self.layer_leaves = [], [], []
        layer_type = []
        for layer in layers:
            graphdef, state = nnx.split(layer)
            leaves, treedef = jax.tree.flatten(state)
            if graphdef not in graphdefs:
                graphdefs.append(graphdef)
                treedefs.append(treedef)
            layer_type.append(graphdefs.index(graphdef))
            self.layer_leaves.append(tuple(leaves))
        self.layer_leaves = tuple(self.layer_leaves)
        self.runs = layer_runs(self.num_layers, group, aux_layers)
        # A kind: the (graphdef, treedef) of each layer of a run; one executable per kind.
        self.kinds: list[tuple] = []
        self.run_kind: list[int] = []
        for a, b in self.runs:
            kind = tuple((graphdefs[layer_type[i]], treedefs[layer_type[i]])
                         for i in range(a, b))
            if kind not in self.kinds:
                self.kinds.append(kind)
            self.run_kind.append(self.kinds.index(kind))


def _replicated(mesh, x):
    return x if mesh is None else jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, P()))


def _head(shell_graphdef, shell_state, last_sampled, input_ids, from_last_sampled,
          token_slots, positions, mm=None):
    """The step's token ids, embeddings (images' encoder rows in place: mm) and rotary
    tables (positions: the batch's rotary_positions)."""
    model = nnx.merge(shell_graphdef, shell_state)
    ids = step_input_ids(last_sampled, input_ids, from_last_sampled, token_slots)
    cos, sin = model.rope(positions)
    x = merge_mm_embeds(model.model.embed_tokens(ids), mm)
    mesh = model.mesh
    return (_replicated(mesh, ids), _replicated(mesh, x), _replicated(mesh, cos),
            _replicated(mesh, sin))


def _layers(kind, mesh, leaves, x, cos, sin, kv_caches, md):
    """A run of decoder layers: leaves and KV caches one tuple per layer."""
    new = []
    for (graphdef, treedef), lv, kv_cache in zip(kind, leaves, kv_caches):
        layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, list(lv)))
        x, kv_cache = layer(x, cos, sin, kv_cache, md)
        new.append(kv_cache)
    return _replicated(mesh, x), tuple(new)


def _lower_runs(lm: LayerwiseModel, leaves, x, cos, sin, kv_caches, md) -> list:
    """One lowered program per kind of run (leaves: each layer's weights, as shapes or arrays;
    x, cos, sin: shapes; kv_caches: the model's)."""
    lowered = []
    for k, kind in enumerate(lm.kinds):
        a, b = lm.runs[lm.run_kind.index(k)]
        fn = jax.jit(partial(_layers, kind, lm.mesh), donate_argnums=(4,))
        lowered.append(fn.lower(leaves[a:b], x, cos, sin, kv_caches[a:b], md))
    return lowered


def _run_all(runs, leaves, x, cos, sin, kv_caches, md, aux_layers=(), aux=None):
    """Dispatch every run in turn: (x, the new KV caches). With aux_layers, the residual
    stream entering each of them goes into `aux` (runs start at aux layers)."""
    new_kv = []
    for fn, a, b in runs:
        if a in aux_layers:
            aux[a] = x
        x, caches = fn(leaves[a:b], x, cos, sin, kv_caches[a:b], md)
        new_kv.extend(caches)
    return x, new_kv


def _bind_runs(lm: LayerwiseModel, compiled: list) -> list:
    """Per run of the model: (its kind's executable, first layer, end)."""
    return [(compiled[k], a, b) for (a, b), k in zip(lm.runs, lm.run_kind)]


def _tail(shell_graphdef, drafter, shell_state, draft_params, draft_kv, sampler, batch, x,
          input_ids, aux, *, features: StepFeatures, max_model_len: int):
    model = nnx.merge(shell_graphdef, shell_state)
    draft = None if drafter is None else drafter.merge(draft_params)
    hidden = model.model.norm(x)
    return step_tail(model, hidden, input_ids, sampler, batch, features=features,
                     target_hidden=jnp.concatenate(aux, axis=-1) if aux else None,
                     draft=draft, draft_kind=drafter.kind if drafter is not None else "",
                     draft_kv=draft_kv, max_model_len=max_model_len)


def _fused(shell_graphdef, drafter, runs, mesh, aux_layers, packed, weights, carry, batch, *,
           features: StepFeatures, max_model_len: int):
    """A whole step over the layer-wise layout: the head, every run of layers and the tail
    in one program (what LayerwiseStep dispatches one by one), reading the same weights
    (shell state, per-layer leaves) and donating the same carry. runs: ((a, b), kind) each.
    packed: a PackedBatch of the bucket's layout (then `batch` is its buffer) or None."""
    if packed is not None:
        batch = packed.unpacked(batch)
    (shell_state, layer_leaves), draft_params = weights
    kv, draft_kv, sampler = carry
    ids, x, cos, sin = _head(shell_graphdef, shell_state, sampler.last_sampled,
                             batch.input_ids, batch.from_last_sampled, batch.token_slots,
                             batch.rotary_positions, batch.mm_inputs)
    aux = {}
    x, new_kv = _run_all([(partial(_layers, kind, mesh), a, b) for (a, b), kind in runs],
                         layer_leaves, x, cos, sin, kv, batch.attn, aux_layers, aux)
    out, draft_kv, sampler = _tail(shell_graphdef, drafter, shell_state, draft_params,
                                   draft_kv, sampler, batch, x, ids,
                                   tuple(aux[i] for i in aux_layers), features=features,
                                   max_model_len=max_model_len)
    return out, (new_kv, draft_kv, sampler)


class LayerwiseProgram:
    """Layer-wise steps of one model (step_program.py's interface): its params in the state
    are (shell state, per-layer leaves); the head and layer executables of a bucket are
    compiled once and shared by every variant of it (only the tail differs)."""

    kind = "layerwise"

    def __init__(self, model, *, group: int, max_model_len: int = 0, draft_model=None,
                 eagle_head=None):
        self.drafter = InStepDrafter.of(draft_model, eagle_head)
        self.aux_layers = self.drafter.aux_layers if self.drafter is not None else ()
        self.model_config = model.config
        self.mesh = model.mesh
        self.lm = LayerwiseModel(model, group, self.aux_layers)
        self.max_model_len = max_model_len
        self._lock = threading.Lock()
        # (T, R, images) -> compiled head, (T, R) -> [compiled layer per kind]; built once
        # per bucket (a head once more for the bucket's steps with images).
        self._shared: dict[tuple, object] = {}
        self._shared_locks: dict[tuple[int, int], threading.Lock] = {}

    def init_state(self, num_blocks: int, block_size: int, kv_dtype,
                   num_slots: int, window_blocks: int = 0) -> StepState:
        return single_stage_state((self.lm.shell_state, self.lm.layer_leaves),
                                  self.model_config, self.mesh, self.drafter, num_blocks,
                                  block_size, kv_dtype, num_slots, window_blocks)

    def place(self, batch: StepBatch):
        return place_replicated(self.mesh, batch)

    def set_params(self, params) -> None:
        """The weights after an update or wake-up (runner/weights.py)."""
        self.lm.shell_state, self.lm.layer_leaves = params

    def _shared_for(self, t: int, r: int, mm: bool, args) -> tuple:
        """The head (per bucket (T, R) and mm: steps with images) and the per-kind layer
        executables (per bucket) every variant of it shares, compiled once (by whichever
        thread asks first; the others wait for it). A model whose image tokens attend both
        ways (attention spans in the steps with images) has layers of their own there."""
        with self._lock:
            lock = self._shared_locks.setdefault((t, r), threading.Lock())
        spans = args[1][5].attn_spans is not None
        layers_key = (t, r, "spans") if spans else (t, r)
        with lock:
            head = self._shared.get((t, r, mm))
            layers = self._shared.get(layers_key)
            if head is None or layers is None:
                head_args, (leaves, x, cos, sin, kv_caches, md) = args
                lm = self.lm
                with TRACE_LOCK:
                    head_lo = (jax.jit(partial(_head, lm.shell_graphdef)).lower(*head_args)
                               if head is None else None)
                    runs = (_lower_runs(lm, leaves, x, cos, sin, kv_caches, md)
                            if layers is None else None)
                if head is None:
                    head = self._shared[(t, r, mm)] = head_lo.compile()
                if layers is None:
                    layers = self._shared[layers_key] = [lo.compile() for lo in runs]
            return head, layers

    def lower(self, t: int, r: int, features: StepFeatures, state: StepState,
              example: StepBatch) -> "LayerwiseLowered":
        """Lower the bucket's tail for this variant; the head and layers are lowered and
        compiled at compile() unless an earlier variant of the bucket already did."""
        lm = self.lm
        example = device_batch(example)
        # (the weights' shapes come from `state`: the live arrays may be replaced meanwhile,
        # a weight update, or deleted, an engine asleep)
        shell, leaves = state.params
        head_args = (shell, state.sampler.last_sampled, example.input_ids,
                     example.from_last_sampled, example.token_slots,
                     example.rotary_positions, example.mm_inputs)
        sharding = None if lm.mesh is None else NamedSharding(lm.mesh, P())
        ids, x, cos, sin = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                            for a in jax.eval_shape(partial(_head, lm.shell_graphdef),
                                                    *head_args))
        layer_args = (leaves, x, cos, sin, state.kv, example.attn)
        tail = jax.jit(partial(_tail, lm.shell_graphdef, self.drafter, features=features,
                               max_model_len=self.max_model_len),
                       donate_argnums=(2, 3))
        lowered = tail.lower(shell, state.draft_params, state.draft_kv, state.sampler,
                             example, x, ids, tuple(x for _ in self.aux_layers))
        return LayerwiseLowered(self, (t, r, features.mm), (head_args, layer_args), lowered)

    def lower_fused(self, features: StepFeatures, state: StepState, example: StepBatch):
        """The bucket of `example` as one whole program over this layout (_fused): what a
        LayerwiseStep swaps in once it is compiled (compiled_steps.py compiles it in the
        background). `.compile()` gives fn(weights, carry, batch) -> (outputs, carry)."""
        lm = self.lm
        runs = tuple((run, lm.kinds[k]) for run, k in zip(lm.runs, lm.run_kind))
        packed = example if isinstance(example, PackedBatch) else None
        fn = jax.jit(partial(_fused, lm.shell_graphdef, self.drafter, runs, lm.mesh,
                             self.aux_layers, packed, features=features,
                             max_model_len=self.max_model_len), donate_argnums=(1,))
        return _FusedLowered(fn.lower(state.weights, state.carry,
                                      packed.spec() if packed is not None else example), packed)


class _FusedLowered:
    def __init__(self, lowered, packed: PackedBatch | None):
        self.lowered, self.packed = lowered, packed

    def compile(self) -> "_Fused":
        return _Fused(self.lowered.compile(), self.packed)


class _Fused:
    """A bucket's compiled whole program over the layer-wise layout (LayerwiseStep.fused):
    (weights, carry, placed batch) -> (outputs, carry)."""

    def __init__(self, compiled, packed: PackedBatch | None):
        self.compiled, self.packed = compiled, packed

    def __call__(self, weights, carry, batch):
        return self.compiled(weights, carry, step_input(batch, self.packed))


class LayerwiseLowered:
    def __init__(self, program: LayerwiseProgram, bucket, shared_args, tail_lowered):
        self.program, self.bucket, self.shared_args = program, bucket, shared_args
        self.tail_lowered = tail_lowered

    def compile(self) -> "LayerwiseStep":
        head, layers = self.program._shared_for(*self.bucket, self.shared_args)
        return LayerwiseStep(self.program, head, layers, self.tail_lowered.compile())


class LayerwiseStep:
    """One bucket and variant's compiled layer-wise step: (state, batch) -> (outputs,
    state), dispatching the head, every run of layers and the tail in turn."""

    def __init__(self, program: LayerwiseProgram, head, layers, tail):
        self.head, self.layers, self.tail = head, layers, tail
        self.runs = _bind_runs(program.lm, layers)  # per run: its executable, its layers
        self.aux_layers = program.aux_layers
        # The same step as one program (LayerwiseProgram.lower_fused), once compiled: then
        # one dispatch per step instead of L / group + 2.
        self.fused = None

    def __call__(self, state: StepState, batch: StepBatch):
        fused = self.fused
        if fused is not None:
            out, carry = fused(state.weights, state.carry, batch)
            return out, state.with_carry(carry)
        batch = device_batch(batch)
        shell_state, layer_leaves = state.params
        ids, x, cos, sin = self.head(shell_state, state.sampler.last_sampled, batch.input_ids,
                                     batch.from_last_sampled, batch.token_slots,
                                     batch.rotary_positions, batch.mm_inputs)
        aux = {}  # (EAGLE-3: the residual stream entering each aux layer)
        x, new_kv = _run_all(self.runs, layer_leaves, x, cos, sin, state.kv, batch.attn,
                             self.aux_layers, aux)
        out, draft_kv, sampler = self.tail(shell_state, state.draft_params, state.draft_kv,
                                           state.sampler, batch, x, ids,
                                           tuple(aux[i] for i in self.aux_layers))
        return out, state.with_carry((new_kv, draft_kv, sampler))


# -- pipeline parallelism: each stage layer-wise ------------------------------------------------

def _stage_head(shell_graphdef, shell_state, first, positions):
    """Stage 0: token ids -> embeddings; later stages: the residual stream as it came. Both:
    the rotary tables of the step's positions."""
    stage = nnx.merge(shell_graphdef, shell_state)
    x = stage.embed_tokens(first) if stage.embed_tokens is not None else first
    cos, sin = stage.rope(positions)
    mesh = stage.mesh
    return _replicated(mesh, x), _replicated(mesh, cos), _replicated(mesh, sin)


def _stage_tail(shell_graphdef, shell_state, sampler, batch: StepBatch, x, *,
                features: StepFeatures):
    stage = nnx.merge(shell_graphdef, shell_state)
    out, _, sampler = step_tail(stage, stage.norm(x), batch.input_ids, sampler, batch,
                                features=features)
    return out, sampler


class PipelineStageSteps:
    """One pipeline stage (this process's) compiled layer-wise: a head, its runs of layers and,
    on the last stage, the tail. Its compiled step is called as the whole stage function is
    (pipeline_step.PipelineCompiled); the weights are the stage's own, held here."""

    def __init__(self, stage, group: int, first: bool, last: bool):
        self.lm = LayerwiseModel(stage, group, container=stage)
        self.first, self.last = first, last

    def lower(self, kv_caches, example: StepBatch, x, sampler_state, features: StepFeatures):
        lm = self.lm
        first = example.input_ids if self.first else x
        head_fn = partial(_stage_head, lm.shell_graphdef)
        head = jax.jit(head_fn).lower(lm.shell_state, first, example.positions)
        sharding = None if lm.mesh is None else NamedSharding(lm.mesh, P())
        xs, cos, sin = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                        for a in jax.eval_shape(head_fn, lm.shell_state, first,
                                                example.positions))
        runs = _lower_runs(lm, lm.layer_leaves, xs, cos, sin, kv_caches, example.attn)
        tail = None
        if self.last:
            tail = jax.jit(partial(_stage_tail, lm.shell_graphdef, features=features),
                           donate_argnums=(1,)).lower(lm.shell_state, sampler_state, example,
                                                      xs)
            out_info = (tail.out_info[0], kv_caches, tail.out_info[1])
        else:
            out_info = (xs, kv_caches)
        return _StageLowered(self, head, runs, tail, out_info)


class _StageLowered:
    def __init__(self, steps: PipelineStageSteps, head, runs, tail, out_info):
        self.steps, self.head, self.runs, self.tail = steps, head, runs, tail
        self.out_info = out_info

    def compile(self) -> "_StageCompiled":
        return _StageCompiled(self.steps, self.head.compile(),
                              [lo.compile() for lo in self.runs],
                              self.tail.compile() if self.tail is not None else None)


class _StageCompiled:
    """Called as pipeline_step calls a whole stage: (params, kv, batch[, x]) -> (x, kv), the
    last stage (params, kv, sampler_state, batch, x) -> (out, kv, sampler_state). `params`
    are the stage's weights, the same arrays as the leaves held here."""

    def __init__(self, steps: PipelineStageSteps, head, runs, tail):
        lm = steps.lm
        self.shell_state, self.leaves = lm.shell_state, lm.layer_leaves
        self.head, self.tail, self.last = head, tail, steps.last
        self.runs = _bind_runs(lm, runs)

    def __call__(self, params, kv, *rest):
        if self.last:
            sampler_state, batch, x = rest
        else:
            batch, x = rest[0], (rest[1] if len(rest) > 1 else None)
        first = batch.input_ids if x is None else x
        x, cos, sin = self.head(self.shell_state, first, batch.positions)
        x, new_kv = _run_all(self.runs, self.leaves, x, cos, sin, kv, batch.attn)
        if not self.last:
            return x, new_kv
        out, sampler_state = self.tail(self.shell_state, sampler_state, batch, x)
        return out, new_kv, sampler_state
