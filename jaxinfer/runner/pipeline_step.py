"""Pipelined steps (step_program.py's interface): one program per stage and bucket (each
stage whole, or layer-wise: layerwise.PipelineStageSteps), where the stages run and how the
residual stream moves between them (PipelinePlan), the lowering of one bucket's stage
functions (lower_pipeline) and the compiled pipelined step (PipelineCompiled)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.runner.kv_cache import allocate_kv_caches
from jaxinfer.runner.step_fn import step_tail
from jaxinfer.runner.step_inputs import StepBatch, StepFeatures
from jaxinfer.runner.step_state import SamplerState, StepState


def pp_stage(graphdef, state, kv_caches, batch: StepBatch, x=None):
    """Stage s < P - 1 of a pipelined step: its layers over the residual stream (stage 0:
    from the token ids). Returns (residual stream [T, H], its KV caches)."""
    stage = nnx.merge(graphdef, state)
    return stage(batch.input_ids if x is None else x, batch.positions, kv_caches, batch.attn)


def pp_last(graphdef, state, kv_caches, sampler: SamplerState, batch: StepBatch, x, *,
            features: StepFeatures):
    """The last stage: its layers, the final norm, then the step's tail."""
    stage = nnx.merge(graphdef, state)
    hidden, kv_caches = stage(x, batch.positions, kv_caches, batch.attn)
    out, _, sampler = step_tail(stage, hidden, batch.input_ids, sampler, batch,
                                features=features)
    return out, kv_caches, sampler


class PipelineProgram:
    """The stages of a pipeline-parallel model, stage s on its own devices (its weights and
    KV caches there; another process's stage: shapes only). The state's params, kv and batch
    are lists with one entry per stage; the sampler state lives with the last stage."""

    def __init__(self, stages: list, groups: list, *, kind: str = "whole",
                 layers_per_program: int):
        self.kind = kind
        self.stages = stages
        self.model_config = stages[-1].config
        self.mesh = stages[-1].mesh
        self.targets = [NamedSharding(st.mesh, P()) if st.mesh is not None else groups[i][0]
                        for i, st in enumerate(stages)]
        self.plan = PipelinePlan(stages, groups, self.targets)
        split = [nnx.split(st) for st in stages]
        self.graphdefs = [g for g, _ in split]
        self.params = [st for _, st in split]
        self.layerwise = None
        if kind == "layerwise":
            from jaxinfer.runner.layerwise import PipelineStageSteps

            last = len(stages) - 1
            self.layerwise = [PipelineStageSteps(st, layers_per_program, s == 0, s == last)
                              if self.plan.local[s] else None for s, st in enumerate(stages)]

    def init_state(self, num_blocks: int, block_size: int, kv_dtype,
                   num_slots: int, window_blocks: int = 0) -> StepState:
        if window_blocks:  # (the worker keeps one pool under pipeline parallelism)
            raise ValueError("a sliding-window pool of its own is not built for pipelines")
        kv = []
        cfg = self.model_config
        for i, st in enumerate(self.stages):
            scfg = dataclasses.replace(cfg, num_hidden_layers=len(st.layers))
            if self.plan.local[i]:
                kv.append(allocate_kv_caches(scfg, num_blocks, block_size, kv_dtype, st.mesh,
                                             device=self.targets[i]))
            else:  # another process's stage: shapes
                shape = (num_blocks, block_size, scfg.num_key_value_heads, scfg.head_dim)
                a = jax.ShapeDtypeStruct(shape, kv_dtype)
                kv.append([(a, a)] * scfg.num_hidden_layers)
        if self.plan.local[-1]:
            sampler = SamplerState.zeros(num_slots, cfg.vocab_size, self.targets[-1])
        else:
            sampler = SamplerState.shapes(num_slots, cfg.vocab_size)
        return StepState(params=self.params, kv=kv, sampler=sampler)

    def place(self, batch: StepBatch) -> list:
        """One copy of the batch per stage, on its devices (another process's stage: the host
        copy, for shapes)."""
        return [jax.device_put(batch, target) if local else batch
                for target, local in zip(self.targets, self.plan.local)]

    def lower(self, t: int, r: int, features: StepFeatures, state: StepState, example: list):
        return lower_pipeline(self.graphdefs, state.params, state.kv, state.sampler,
                              self.plan, self.targets, example, features, self.layerwise)


class PipelineLowered:
    """The lowered stage functions of one bucket and variant (this process's stages)."""

    def __init__(self, lowered: list, plan: "PipelinePlan", shapes: dict):
        self.lowered, self.plan, self.shapes = lowered, plan, shapes

    def compile(self) -> "PipelineCompiled":
        return PipelineCompiled([lo.compile() if lo is not None else None
                                  for lo in self.lowered], self.plan, self.shapes)


class PipelinePlan:
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


class PipelineCompiled:
    """Runs a pipelined step: stage by stage (this process's stages), the residual stream
    moved between them; every call is dispatched asynchronously (nothing here waits)."""

    def __init__(self, stages: list, plan: PipelinePlan, shapes: dict):
        self.stages, self.plan, self.shapes = stages, plan, shapes

    def __call__(self, state: StepState, batches: list):
        out, kv, sampler = self._run(state.params, state.kv, state.sampler, batches)
        return out, state.with_carry((kv, None, sampler))

    def _run(self, params: list, kv: list, sampler_state, batches: list):
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


def lower_pipeline(graphdefs: list, states: list, kv_caches: list, sampler_state, plan,
                   stage_targets: list, examples: list, features,
                   layerwise: list | None = None) -> PipelineLowered:
    """Lower one bucket's stage functions: stage s < P - 1 (layers over the residual stream,
    stage 0 from the token ids), then the last (layers, norm, LM head, sampler). Another
    process's stage is only shape-evaluated (its output shapes feed the transport).
    layerwise: per stage, its layerwise.PipelineStageSteps (None: the stage compiles whole)."""
    if features.spec:
        raise ValueError("speculative decoding is not supported with pipeline parallelism")
    lowered, x = [], None
    shapes: dict = {"x": []}
    last = len(graphdefs) - 1
    for s, (graphdef, state) in enumerate(zip(graphdefs, states)):
        if s:  # the residual stream of the previous stage, on this stage's devices
            target = stage_targets[s]
            if not isinstance(target, jax.sharding.Sharding):
                target = jax.sharding.SingleDeviceSharding(target)
            prev = shapes["x"][-1]
            x = jax.ShapeDtypeStruct(prev.shape, prev.dtype, sharding=target)
        if s < last:
            fn = jax.jit(partial(pp_stage, graphdef), donate_argnums=(1,))
            args = (state, kv_caches[s], examples[s]) + (() if s == 0 else (x,))
        else:
            fn = jax.jit(partial(pp_last, graphdef, features=features), donate_argnums=(1, 2))
            args = (state, kv_caches[s], sampler_state, examples[s], x)
        if plan.local[s] and layerwise is not None and layerwise[s] is not None:
            lowered.append(layerwise[s].lower(kv_caches[s], examples[s], x, sampler_state,
                                              features))
            info = lowered[-1].out_info
        elif plan.local[s]:
            lowered.append(fn.lower(*args))
            info = lowered[-1].out_info
        else:  # another process's stage: its output shapes only
            lowered.append(None)
            info = jax.eval_shape(fn, *args)
        if s < last:
            shapes["x"].append(info[0])
        else:
            shapes["out"] = info[0]
    return PipelineLowered(lowered, plan, shapes)
