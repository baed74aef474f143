"""Build a model from an HF folder (single or sharded safetensors) or with dummy weights.

The module is first built abstractly (nnx.eval_shape: no memory), then every parameter is filled
from the checkpoint tensor of the same dotted name, transposed for Linear weights ([out, in] in
HF, [in, out] here) and cast to the requested dtype. `load_format="dummy"` initialises random
weights of the right shapes inside one jitted function, so they are made directly on device.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig, resolve_dtype
from jaxinfer.models.fused import (TIED_LM_HEAD, checkpoint_names, fuse, logical_shape,
                                   source_shape, to_param_layout)
from jaxinfer.models.registry import get_model_class
from jaxinfer.parallel import param_spec, replicate_kv_heads, sharding, tp_model_config

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# HF's [out, in] linear weights (Mixtral's experts: w1/w2/w3; MoE routers: gate.weight).
_TRANSPOSED_SUFFIXES = ("_proj.weight", "lm_head.weight", ".w1.weight", ".w2.weight",
                        ".w3.weight", ".gate.weight", "shared_expert_gate.weight")
_KV_SUFFIXES = ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def _param_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _safetensors_index(model_dir: str) -> dict[str, str]:
    """tensor name -> file, for single or sharded (model.safetensors.index.json) checkpoints."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, fn) for name, fn in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {model_dir}"
        )
    from safetensors import safe_open

    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}


def _iter_tensors(files_by_name: dict[str, str], wanted: list[str]):
    """(name, host numpy array) for each wanted tensor, one file open at a time."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files_by_name[name], []).append(name)
    for fn, names in by_file.items():
        with safe_open(fn, framework="numpy") as f:
            for name in names:
                yield name, f.get_tensor(name)


def _host_tensor(name: str, tensor: np.ndarray, expected_shape, dtype, *, kv_repeat: int,
                 head_dim: int) -> np.ndarray:
    """Checkpoint tensor -> the model's layout ([in, out], KV heads replicated), checked."""
    if kv_repeat > 1 and name.endswith(_KV_SUFFIXES):
        tensor = replicate_kv_heads(tensor, kv_repeat, head_dim)
    if name.endswith(_TRANSPOSED_SUFFIXES):
        tensor = tensor.T
    if tuple(tensor.shape) != tuple(expected_shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)} (after transposing HF's [out, in] "
            f"layout where it applies) but the model expects {tuple(expected_shape)}"
        )
    return tensor.astype(dtype)


def _place(name: str, tensor: np.ndarray, *, mesh, to_host: bool = False,
           expert_parallel: bool = False) -> jax.Array:
    """Host tensor -> device array, placed straight into its shards."""
    tensor = np.ascontiguousarray(tensor)
    if to_host:  # (pipeline stages place their own parameters)
        return tensor
    if mesh is None:
        return jax.device_put(tensor)
    # Each device (of every process) receives only its own slice.
    spec = sharding(mesh, param_spec(name, tensor.shape, mesh.size, expert_parallel))
    return jax.make_array_from_callback(tensor.shape, spec, lambda idx: tensor[idx])


def build_model(model_config: ModelConfig, *, dtype: str, attention_backend: str, seed: int = 0,
                mesh=None, tp: int = 1):
    """A function building the model (packed CPU weights only where it runs on one device)."""
    from jaxinfer.layers.cpu_kernels import packing

    cls = get_model_class(model_config.architecture)

    def make():
        with packing(tp == 1):
            return cls(model_config, dtype=_dtype(dtype), attention_backend=attention_backend,
                       rngs=nnx.Rngs(seed), mesh=mesh)

    return make


def load_model(model_dir: str, *, dtype: str = "auto", load_format: str = "auto",
               attention_backend: str = "xla", seed: int = 0,
               model_config: ModelConfig | None = None, mesh=None, to_host: bool = False,
               tp_size: int | None = None, expert_parallel: bool = False,
               sequence_parallel: bool = False):
    """Returns (model, model_config, dtype_name). With a mesh (tensor parallelism), every
    parameter goes from host memory straight into its shards, and the returned config has its
    KV heads replicated up to the mesh size where they were fewer. to_host: parameters stay
    numpy arrays in host memory (pipeline stages place them), KV heads replicated up to
    tp_size. expert_parallel: a mixture-of-experts model's experts split by expert over the
    devices (enable_expert_parallel), not each expert over them. sequence_parallel: the
    residual stream token-sharded between tensor-parallel regions."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={load_format!r} is not supported (supported: {', '.join(LOAD_FORMATS)})"
        )
    model_config = model_config or ModelConfig.from_pretrained(model_dir)
    tp = tp_size if tp_size is not None else (1 if mesh is None else mesh.size)
    model_config, kv_repeat = tp_model_config(model_config, tp, expert_parallel,
                                              sequence_parallel)
    ep = model_config.expert_parallel
    dtype_name = resolve_dtype(dtype, model_config)
    make = build_model(model_config, dtype=dtype_name, attention_backend=attention_backend,
                       seed=seed, mesh=mesh, tp=tp)
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    flat = nnx.to_flat_state(abstract)
    names = [_param_name(path) for path, _ in flat]
    if load_format == "dummy":
        shardings = nnx.from_flat_state([
            (path, sharding(mesh, param_spec(name, var.shape, tp, ep)) if mesh else None)
            for (path, var), name in zip(flat, names)])
        def dummy():
            model = make()
            getattr(model.model, "embed_tokens").tie()  # (a packed tied LM head: its table^T)
            return nnx.state(model)

        init = jax.jit(dummy, out_shardings=shardings if mesh is not None else None)
        state = init()
        if to_host:
            state = jax.device_get(state)
        return nnx.merge(graphdef, state), model_config, dtype_name

    files_by_name = _safetensors_index(model_dir)
    expected = {name: var for (_, var), name in zip(flat, names)}
    sources = {name: checkpoint_names(name, logical_shape(expected[name]))
               for name in names}  # fused params: several
    owners: dict[str, list[str]] = {}  # (a tied packed LM head shares the embedding's tensor)
    for name in names:
        for src in sources[name]:
            owners.setdefault(src, []).append(name)
    wanted = list(owners)
    missing = [n for n in wanted if n not in files_by_name]
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    head_dim = model_config.head_dim
    pending: dict[str, dict[str, np.ndarray]] = {}  # fused params still missing a part
    for src, tensor in _iter_tensors(files_by_name, wanted):
        for name in owners[src]:
            var = expected[name]
            srcs = sources[name]
            want = logical_shape(var)
            if name.endswith(TIED_LM_HEAD):  # the embedding [V, H], transposed
                value = _host_tensor(src, tensor, want[::-1], var.dtype, kv_repeat=kv_repeat,
                                     head_dim=head_dim).T
                var.set_value(_place(name, to_param_layout(var, value), mesh=mesh,
                                     to_host=to_host, expert_parallel=ep))
                continue
            shape = want if len(srcs) == 1 else source_shape(name, src, want, head_dim)
            parts = pending.setdefault(name, {})
            parts[src] = _host_tensor(src, tensor, shape, var.dtype, kv_repeat=kv_repeat,
                                      head_dim=head_dim)
            if len(parts) < len(srcs):
                continue
            del pending[name]
            value = (parts[src] if len(srcs) == 1
                     else fuse(name, [parts[s] for s in srcs], head_dim))
            var.set_value(_place(name, to_param_layout(var, value), mesh=mesh,
                                 to_host=to_host, expert_parallel=ep))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model, model_config, dtype_name
