"""Pipeline parallelism (one process): the decoder layers split over P stages, each stage on
its own devices (tensor_parallel_size of them: a `pp x tp` grid), several step batches in
flight.

Layers are partitioned as vLLM's get_pp_indices does (even, the remainder on the stages
before the last, from the second-to-last backwards; `pp_layer_partition` / the env var
JAXINFER_PP_LAYER_PARTITION="4,4,5,3" overrides). Stage 0 holds the embedding and its layers,
the last stage its layers, the final norm and the LM head (with tied embeddings, a copy of the
embedding: vLLM does the same); each stage's weights and KV cache live on its devices only.

A step is P compiled functions, one per stage and bucket: stage s reads the residual stream
[T, H] of stage s - 1, moved with jax.device_put onto its devices (a device-to-device copy),
and the last stage samples. Every call is dispatched asynchronously, so while stage 1 runs
batch k the host has already dispatched stage 0 of batch k + 1: EngineCore keeps up to P
batches in flight (one step loop, vLLM's step_with_batch_queue), and the scheduler never puts a request into
a batch while it is in another one in flight.

Multi-host (jax.distributed): each stage sits within one process, which alone holds its
weights and caches (the others keep shapes only); between stages of different processes the
residual stream moves by a collective over the global ('pp', 'tp') mesh
(runner/pipeline_step.py's PipelinePlan), and so do the sampled outputs back to process 0, which schedules.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.config.parallel import stage_bounds
from jaxinfer.layers import module_list


def stage_devices(pp: int, tp: int, devices=None) -> list[list]:
    devices = list(devices) if devices is not None else jax.devices()
    if pp * tp > len(devices):
        raise ValueError(f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} needs "
                         f"{pp * tp} devices, {len(devices)} {devices[0].platform} device(s) "
                         f"available")
    return [devices[s * tp:(s + 1) * tp] for s in range(pp)]


class PipelineStage(nnx.Module):
    """One stage: [embedding] + a contiguous run of decoder layers [+ final norm, LM head]."""

    def __init__(self, cfg: ModelConfig, layers, *, embed=None, norm=None, lm_head=None,
                 tied_embed=None, mesh=None, family=None):
        """family: the whole model's class (its rope tables and logit finishing)."""
        self.config = cfg
        self.family = family
        self.mesh = mesh
        self.embed_tokens = embed
        self.layers = module_list(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.tied_embed = tied_embed  # the last stage's copy of a tied embedding

    @property
    def is_last(self) -> bool:
        return self.norm is not None

    def __call__(self, x, positions, kv_caches, md):
        """Stage 0: x = token ids [T]; others: the residual stream [T, H]. Returns the
        residual stream (last stage: normalised) and the stage's updated KV caches."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        cos, sin = self.rope(positions)
        new = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, cos, sin, kv, md)
            new.append(kv)
        if self.norm is not None:
            x = self.norm(x)
        return x, new

    def rope(self, positions):
        """positions int32 [T] -> the rotary cos, sin of this stage's layers (the whole
        model's: its family's rope_tables)."""
        return self.family.rope_tables(self.config, positions)

    def compute_logits(self, hidden):
        import jax.numpy as jnp

        if self.lm_head is None:
            logits = self.tied_embed.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            logits = jax.lax.with_sharding_constraint(
                logits, NamedSharding(self.mesh, PartitionSpec()))
        return self.family.final_logits(self.config, logits.astype(jnp.float32))


def _placed(module, mesh, device, expert_parallel: bool = False):
    """`module` with every parameter on the stage's devices (TP-sharded by its declared axes),
    from host memory straight to each device's part."""
    from jaxinfer.parallel import param_spec, sharding

    tp = 1 if mesh is None else mesh.size
    graphdef, state = nnx.split(module)

    def put(var):  # (a new Variable: a tied embedding's arrays are shared between stages)
        x = var.get_value()
        if mesh is None:
            return var.replace(jax.device_put(x, device))
        spec = sharding(mesh, param_spec(var, tp, expert_parallel))
        return var.replace(jax.make_array_from_callback(x.shape, spec, lambda idx: x[idx]))

    return nnx.merge(graphdef, jax.tree.map(put, state,
                                            is_leaf=lambda v: isinstance(v, nnx.Variable)))


def split_model(model, parts: list[int], groups: list[list], meshes: list) -> list[PipelineStage]:
    """The loaded whole model -> P stages, each moved onto its own devices."""
    cfg = model.config
    stages = []
    bounds = stage_bounds(parts)
    last = len(parts) - 1
    for s, (a, b) in enumerate(bounds):
        mesh, device = meshes[s], groups[s][0]
        layers = list(model.model.layers)[a:b]
        for layer in layers:  # attention (and a MoE block) run under this stage's mesh
            layer.self_attn.mesh = mesh
            if cfg.sequence_parallel:
                layer.sp_mesh = mesh
            ffn = getattr(layer, layer.ffn_name)
            if hasattr(ffn, "expert_parallel"):
                ffn.mesh = mesh
        tied = None
        if s == last and model.lm_head is None:  # tied: the last stage gets its own copy
            graphdef, state = nnx.split(model.model.embed_tokens)
            tied = nnx.merge(graphdef, state)
        stage = PipelineStage(cfg, layers, embed=model.model.embed_tokens if s == 0 else None,
                              norm=model.model.norm if s == last else None,
                              lm_head=model.lm_head if s == last else None,
                              tied_embed=tied, mesh=mesh, family=type(model))
        if is_local(groups[s]):
            stage = _placed(stage, mesh, device, cfg.expert_parallel)
        else:  # another process's stage: only its shapes are kept here
            graphdef, state = nnx.split(stage)
            stage = nnx.merge(graphdef, jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state))
        stages.append(stage)
    return stages


def is_local(group) -> bool:
    """The stage's devices belong to this process (each stage sits within one process)."""
    owners = {d.process_index for d in group}
    if len(owners) != 1:
        raise ValueError(f"a pipeline stage spans processes {sorted(owners)}: make "
                         f"tensor_parallel_size divide each process's device count")
    return owners == {jax.process_index()}
