"""Tensor parallelism: the device mesh, parameter-name -> PartitionSpec rules, shardings.

One mesh axis, "tp". Every parameter declares its logical axes where it is created
(layers/params.py); `sharding_rules` maps them to the mesh: attention heads and MLP columns are
split over it (column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj, whose
partial sums XLA all-reduces; in a mixture-of-experts block every expert split the same way,
or with expert parallelism the experts themselves, E / tp per device: layers/moe.py), the
embedding and LM head are vocab-parallel. The KV cache is split by KV head, and attention runs
per device under jax.shard_map. When tp exceeds the KV heads, each KV head is replicated so
every device holds one (as vLLM does).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig

TP = "tp"


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh | None:
    """A 1-D mesh over the first tp of `devices` (default: all JAX devices; a data-parallel
    rank passes its own); None for tp == 1 (plain single-device jit)."""
    devices = list(devices) if devices is not None else jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} exceeds the "
                         f"{len(devices)} available {devices[0].platform} device(s)")
    if tensor_parallel_size == 1 and devices[0] == jax.devices()[0]:
        return None  # the default device: plain jit
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,),
                axis_types=(jax.sharding.AxisType.Auto,))


def tp_model_config(cfg: ModelConfig, tp: int, expert_parallel: bool = False,
                    sequence_parallel: bool = False) -> tuple[ModelConfig, int]:
    """Check divisibility; returns the config to build (KV heads replicated up to tp when
    tp exceeds them; expert_parallel set for a mixture-of-experts model when asked for;
    sequence_parallel when asked for) and the KV-head replication factor."""
    if tp == 1:
        return cfg, 1
    if sequence_parallel:
        cfg = dataclasses.replace(cfg, sequence_parallel=True)
    if expert_parallel and cfg.num_experts:
        if cfg.num_experts % tp:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size={tp} must divide "
                             f"num_experts={cfg.num_experts}")
        cfg = dataclasses.replace(cfg, expert_parallel=True)
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads="
                         f"{cfg.num_attention_heads}")
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if dense and cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size="
                         f"{cfg.intermediate_size}")
    if cfg.num_experts and not cfg.expert_parallel and cfg.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide moe_intermediate_size="
                         f"{cfg.moe_intermediate_size} (each expert is split over the devices)")
    if cfg.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide shared_expert_intermediate_size="
                         f"{cfg.shared_expert_intermediate_size}")
    hkv = cfg.num_key_value_heads
    if hkv % tp == 0:
        return cfg, 1
    if tp % hkv:
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={hkv}: one must "
                         "divide the other")
    return dataclasses.replace(cfg, num_key_value_heads=tp), tp // hkv


def replicate_kv_heads(w: np.ndarray, factor: int, head_dim: int) -> np.ndarray:
    """HF k/v projection weight [Hkv*D, H] (or bias [Hkv*D]) -> each head repeated `factor`
    times, consecutively, so KV head j serves query-head group j // factor as before."""
    if factor == 1:
        return w
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    return np.repeat(heads, factor, axis=0).reshape(-1, *w.shape[1:])


def sharding_rules(expert_parallel: bool = False) -> dict[str, str | None]:
    """Logical axis (layers/params.py) -> mesh axis: attention heads, KV heads, MLP columns and
    the vocabulary split over "tp"; stacked experts split within each expert, or (expert
    parallelism) by expert. Any other axis stays whole."""
    return {"heads": TP, "kv_heads": TP, "mlp": TP, "vocab": TP,
            "experts": TP if expert_parallel else None,
            "expert_mlp": None if expert_parallel else TP}


def param_spec(var, tp: int, expert_parallel: bool = False) -> P:
    """PartitionSpec of a parameter from its declared logical axes (a vocabulary that tp does
    not divide stays whole)."""
    if tp == 1:
        return P()
    axes = getattr(var, "axes", None) or (None,) * len(var.shape)  # (layers/params.py)
    rules = sharding_rules(expert_parallel)
    spec = []
    for axis, size in zip(axes, var.shape):
        mesh_axis = rules.get(axis)
        if mesh_axis is not None and axis == "vocab" and size % tp:
            mesh_axis = None
        spec.append(mesh_axis)
    return P(*spec)


def sequence_shard(x, mesh: Mesh | None):
    """Sequence parallelism (Megatron-style): the residual stream [T, H] split by tokens over
    the mesh between tensor-parallel regions. XLA then reduce-scatters the row-parallel
    projections' partial sums (instead of all-reducing them; its CPU pipeline keeps that as
    an all-reduce and a slice, GPU pipelines form a reduce-scatter), runs the norms and
    residual adds on each device's tokens, and all-gathers the tokens before the next
    column-parallel projection. (A bucket of T tokens not divisible by the devices is padded
    by XLA.)"""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(TP, None)))


def sharding(mesh: Mesh | None, spec: P):
    return None if mesh is None else NamedSharding(mesh, spec)


KV_CACHE_SPEC = P(None, None, TP, None)  # [num_blocks, block_size, Hkv, D]
ATTN_Q_SPEC = P(None, TP, None)  # [T, H, D]
