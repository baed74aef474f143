"""Tensor parallelism: the device mesh, parameter-name -> PartitionSpec rules, shardings.

One mesh axis, "tp". Attention heads and MLP columns are split over it (column-parallel q/k/v
and gate/up, row-parallel o_proj and down_proj, whose partial sums XLA all-reduces), the
embedding and LM head are vocab-parallel, the KV cache is split by KV head, and attention runs
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


def tp_model_config(cfg: ModelConfig, tp: int) -> tuple[ModelConfig, int]:
    """Check divisibility; returns the config to build (KV heads replicated up to tp when
    tp exceeds them) and the KV-head replication factor."""
    if tp == 1:
        return cfg, 1
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads="
                         f"{cfg.num_attention_heads}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size="
                         f"{cfg.intermediate_size}")
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


def param_spec(name: str, shape: tuple[int, ...], tp: int) -> P:
    """PartitionSpec of a parameter from its (HF-style) name; our Linear weights are [in, out]."""
    if tp == 1:
        return P()
    if name.endswith("qkv_proj.weight"):  # [in, Hkv, (G+2)*D]: by KV head with its group
        return P(None, TP, None)
    if name.endswith("qkv_proj.bias"):  # [Hkv, (G+2)*D]
        return P(TP, None)
    if name.endswith("gate_up_proj.weight"):  # [in, 2, I]
        return P(None, None, TP)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return P(TP, None)
    if name.endswith("embed_tokens.weight"):
        return P(TP, None) if shape[0] % tp == 0 else P()
    if name.endswith("lm_head.weight"):
        return P(None, TP) if shape[1] % tp == 0 else P()
    return P()  # norms


def sharding(mesh: Mesh | None, spec: P):
    return None if mesh is None else NamedSharding(mesh, spec)


KV_CACHE_SPEC = P(None, None, TP, None)  # [num_blocks, block_size, Hkv, D]
ATTN_Q_SPEC = P(None, TP, None)  # [T, H, D]
