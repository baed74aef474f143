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
from flax import nnx

from jaxinfer.config import ModelConfig, resolve_dtype
from jaxinfer.models.registry import get_model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_TRANSPOSED_SUFFIXES = ("_proj.weight", "lm_head.weight")


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

    with safe_open(single, framework="flax") as f:
        return {name: single for name in f.keys()}


def _read_tensors(files_by_name: dict[str, str], wanted: list[str]) -> dict[str, jax.Array]:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files_by_name[name], []).append(name)
    out = {}
    for fn, names in by_file.items():
        with safe_open(fn, framework="flax") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def _checkpoint_value(name: str, tensor: jax.Array, expected_shape, dtype) -> jax.Array:
    if name.endswith(_TRANSPOSED_SUFFIXES):
        tensor = tensor.T
    if tuple(tensor.shape) != tuple(expected_shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)} (after transposing HF's [out, in] "
            f"layout where it applies) but the model expects {tuple(expected_shape)}"
        )
    return tensor.astype(dtype)


def build_model(model_config: ModelConfig, *, dtype: str, attention_backend: str, seed: int = 0):
    cls = get_model_class(model_config.architecture)
    return lambda: cls(model_config, dtype=_dtype(dtype), attention_backend=attention_backend,
                       rngs=nnx.Rngs(seed))


def load_model(model_dir: str, *, dtype: str = "auto", load_format: str = "auto",
               attention_backend: str = "reference", seed: int = 0,
               model_config: ModelConfig | None = None):
    """Returns (model, model_config, dtype_name)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={load_format!r} is not supported (supported: {', '.join(LOAD_FORMATS)})"
        )
    model_config = model_config or ModelConfig.from_pretrained(model_dir)
    dtype_name = resolve_dtype(dtype, model_config)
    make = build_model(model_config, dtype=dtype_name, attention_backend=attention_backend,
                       seed=seed)
    if load_format == "dummy":
        graphdef, state = nnx.split(nnx.eval_shape(make))
        state = jax.jit(lambda: nnx.state(make()))()
        return nnx.merge(graphdef, state), model_config, dtype_name

    graphdef, params = nnx.split(nnx.eval_shape(make))
    flat = nnx.to_flat_state(params)
    files_by_name = _safetensors_index(model_dir)
    names = [_param_name(path) for path, _ in flat]
    missing = [n for n in names if n not in files_by_name]
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    tensors = _read_tensors(files_by_name, names)
    for (_, var), name in zip(flat, names):
        var.set_value(_checkpoint_value(name, tensors.pop(name), var.shape, var.dtype))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model, model_config, dtype_name
