"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the
layout of the model's LoRA slots (layers/lora.py): per targeted projection, A [in, P*R] and
B [P*R, *out] with the scaling folded into B, each part of a fused projection (q/k/v,
gate/up) in its own block. Everything an adapter may not do is refused by name, with the
adapter's name and the reason (ValueError): DoRA, modules_to_save, LoRA biases, per-module
rank or alpha patterns, embedding / LM-head LoRA, mixture-of-experts projections, target
modules the base model does not have, a rank above max_lora_rank, shapes that do not fit,
an unreadable or non-finite file."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxinfer.layers.params import checkpoint_names, fuse
from jaxinfer.parallel import replicate_kv_heads

_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_(A|B)(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclasses.dataclass
class Target:
    """A projection of the model with LoRA slots: its parameters' path, the HF modules it is
    made of (one, or the parts of a fused one) and its module (to read shapes)."""

    path: str  # e.g. model.layers.0.self_attn.qkv_proj
    hf_modules: tuple[str, ...]  # e.g. (...q_proj, ...k_proj, ...v_proj)
    module: object


@dataclasses.dataclass
class Adapter:
    """A loaded adapter: per target path, one slot's (A, B) host arrays (adapter._layout)."""

    name: str
    lora_int_id: int
    path: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def find_targets(model) -> dict[str, Target]:
    """Every projection of `model` that has LoRA slots, by its parameters' path."""
    from flax import nnx

    targets = {}
    for path, node in nnx.iter_graph(model):
        if getattr(node, "lora_a", None) is None or not isinstance(node, nnx.Module):
            continue
        name = ".".join(str(p) for p in path)
        hf = tuple(n[: -len(".weight")] for n in checkpoint_names(name + ".weight", node.weight))
        targets[name] = Target(name, hf, node)
    return targets


def _refuse(name: str, reason: str):
    raise ValueError(f"LoRA adapter {name!r}: {reason}")


def _read_config(name: str, folder: str) -> dict:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isdir(folder):
        _refuse(name, f"lora_path {folder!r} is not a folder")
    if not os.path.isfile(path):
        _refuse(name, f"no adapter_config.json in {folder!r}")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        _refuse(name, f"adapter_config.json is not valid JSON: {e}")
    if not isinstance(config, dict):
        _refuse(name, "adapter_config.json is not a JSON object")
    return config


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a LoRA adapter_config.json, or ValueError naming what is refused."""
    kind = str(config.get("peft_type") or "LORA").upper()
    if kind != "LORA":
        _refuse(name, f"peft_type {kind!r} is not supported (only LORA)")
    if config.get("use_dora"):
        _refuse(name, "DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        _refuse(name, f"modules_to_save {config['modules_to_save']!r} is not supported")
    if str(config.get("bias") or "none") != "none":
        _refuse(name, f"bias={config['bias']!r} is not supported (only 'none')")
    if config.get("target_parameters"):
        _refuse(name, f"target_parameters {config['target_parameters']!r} (LoRA on parameters, "
                      "such as a mixture-of-experts block's fused experts) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            _refuse(name, f"{key} (per-module ranks or alphas) is not supported")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        _refuse(name, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        _refuse(name, f"rank r={r} exceeds max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        _refuse(name, f"lora_alpha must be a number, got {alpha!r}")
    rslora = bool(config.get("use_rslora", False))
    return r, float(alpha) / (math.sqrt(r) if rslora else r)


_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def _read_tensors(name: str, folder: str) -> dict[str, np.ndarray]:
    """Every tensor of adapter_model.safetensors as float32 (bf16 ones widened: numpy has no
    bfloat16), read by its header: a file that does not parse is refused by name."""
    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(folder, "adapter_model.bin")):
            _refuse(name, "only adapter_model.safetensors is supported (found "
                          "adapter_model.bin: save the adapter with safe_serialization)")
        _refuse(name, f"no adapter_model.safetensors in {folder!r}")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
            base = 8 + n
            out = {}
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                dtype = _DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ValueError(f"tensor {key!r} has dtype {info['dtype']}, not a float")
                start, end = info["data_offsets"]
                shape = tuple(info["shape"])
                count = math.prod(shape)
                if not 0 <= start <= end <= size - base or \
                        end - start != count * np.dtype(dtype).itemsize:
                    raise ValueError(f"tensor {key!r}: offsets {start}..{end} do not fit")
                f.seek(base + start)
                raw = np.frombuffer(f.read(end - start), dtype).reshape(shape)
                if info["dtype"] == "BF16":
                    raw = (raw.astype(np.uint32) << 16).view(np.float32)
                out[key] = raw.astype(np.float32)
            return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        _refuse(name, f"cannot read adapter_model.safetensors: {type(e).__name__}: {e}")


def _unknown_module(name: str, module: str, key: str):
    if re.search(r"\.experts(\.|$)|\.mlp\.(gate|shared_expert\w*)(\.|$)", module):
        _refuse(name, f"tensor {key!r} targets {module!r}, a mixture-of-experts block "
                      "(LoRA on experts, routers and shared experts is not supported: target "
                      "the attention projections)")
    if module.endswith(("embed_tokens", "lm_head")):
        _refuse(name, f"tensor {key!r}: embedding / LM-head LoRA is not supported")
    _refuse(name, f"tensor {key!r}: target module {module!r} is not a projection of the base "
                  "model that LoRA can target (q/k/v/o/gate/up/down_proj)")


def load_adapter(lora_name: str, lora_int_id: int, folder: str, targets: dict[str, Target],
                 max_rank: int, head_dim: int, dtype) -> Adapter:
    """The adapter in `folder`, laid out for `targets` (find_targets), as `dtype` arrays."""
    config = _read_config(lora_name, folder)
    rank, scaling = _check_config(lora_name, config, max_rank)
    tensors = _read_tensors(lora_name, folder)
    where = {hf: (t, j) for t in targets.values() for j, hf in enumerate(t.hf_modules)}
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = ("DoRA magnitudes" if "lora_magnitude" in key else
                    "embedding / LM-head LoRA (or saved embedding weights)"
                    if "lora_embedding" in key or re.search(r"embed_tokens|lm_head", key)
                    else "an unknown tensor")
            _refuse(lora_name, f"tensor {key!r} is {what}: not supported")
        module, ab = m.group(1), m.group(2)
        if module not in where:
            _unknown_module(lora_name, module, key)
        if not np.isfinite(value).all():
            _refuse(lora_name, f"tensor {key!r} has non-finite values")
        pairs.setdefault(module, {})[ab] = value
    if not pairs:
        _refuse(lora_name, "adapter_model.safetensors holds no LoRA tensors")
    parts: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            _refuse(lora_name, f"module {module!r} has lora_{'A' if 'A' in ab else 'B'} "
                               "without its pair")
        target, j = where[module]
        a, b = ab["A"], ab["B"]  # HF: A [r, in], B [out, r]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            _refuse(lora_name, f"module {module!r}: lora_A {a.shape} / lora_B {b.shape} are "
                               f"not a rank <= max_lora_rank={max_rank} pair")
        parts.setdefault(target.path, {})[j] = (a, b)
    weights = {}
    for path, got in parts.items():
        target = targets[path]
        weights[path] = _layout(lora_name, target, got, scaling, head_dim, dtype)
    return Adapter(lora_name, lora_int_id, folder, rank, weights)


def _layout(name: str, target: Target, got: dict, scaling: float, head_dim: int, dtype):
    """The parts of one target -> one slot's (A [in, P*R], B [R, *out]; gate/up: [2, R, I])
    (layers/lora.py: part j's A in columns [j*R, j*R + r), its B in its own output columns)."""
    mod = target.module
    in_features, _, width = mod.lora_a.shape
    n_parts = len(target.hf_modules)
    rank = width // n_parts
    out_shape = ((mod.lora_b.shape[0], *mod.lora_b.shape[3:]) if n_parts == 2
                 else tuple(mod.lora_b.shape[2:]))
    if n_parts == 3:  # q/k/v: per KV head, its query group then its key and value head
        kv_heads = out_shape[0]
        group = out_shape[1] // head_dim - 2
        widths = (kv_heads * group * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    elif n_parts == 2:  # gate/up, stacked
        widths = (out_shape[1],) * 2
    else:
        widths = (out_shape[0],)
    a_full = np.zeros((in_features, width), np.float32)
    cols = [np.zeros((rank, w), np.float32) for w in widths]  # each part's B^T, [R, out_j]
    for j, (a, b) in got.items():
        r = a.shape[0]
        if a.shape[1] != in_features:
            _refuse(name, f"{target.hf_modules[j]}: lora_A has {a.shape[1]} inputs, the base "
                          f"projection {in_features}")
        if n_parts == 3 and j > 0 and b.shape[0] != widths[j] and b.shape[0] % head_dim == 0 \
                and widths[j] % b.shape[0] == 0:  # (KV heads replicated for TP)
            b = replicate_kv_heads(b, widths[j] // b.shape[0], head_dim)
        if b.shape[0] != widths[j]:
            _refuse(name, f"{target.hf_modules[j]}: lora_B has {b.shape[0]} outputs, the base "
                          f"projection {widths[j]}")
        a_full[:, j * rank: j * rank + r] = a.T
        cols[j][:r] = b.T * scaling
    if n_parts == 3:
        b_full = fuse(mod.weight, cols, head_dim)  # [R, Hkv, (G+2)*D]
    elif n_parts == 2:
        return a_full.astype(dtype), np.stack(cols).astype(dtype)  # [2, R, I]
    else:
        b_full = cols[0]
    return a_full.astype(dtype), b_full.reshape(rank, *out_shape).astype(dtype)
