"""Fused projections built from HF checkpoint tensors at load time.

The model holds `self_attn.qkv_proj` (QKVLinear: weight [in, Hkv, (G+2)*D], bias
[Hkv, (G+2)*D]) and `mlp.gate_up_proj` (GateUpLinear: weight [in, 2, I]); checkpoints hold
q_proj / k_proj / v_proj and gate_proj / up_proj. Mixture-of-experts layers stack their experts:
`experts.gate_up_proj` [E, H, 2, I] and `experts.down_proj` [E, I, H] from the per-expert
`experts.N.gate_proj / up_proj / down_proj` (Qwen3-MoE) or `experts.N.w1 / w3 / w2` (Mixtral's
`block_sparse_moe`). `checkpoint_names` says which tensors a
parameter is made of, `source_shape` what each must look like (in our [in, out] layout, so a
wrong tensor is named in the error), `fuse` joins them.
"""

from __future__ import annotations

import numpy as np

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# A tied LM head packed for the CPU matmul kernel: the embedding table's transpose.
TIED_LM_HEAD = "embed_tokens.lm_weight"


def _split(name: str) -> tuple[str, str, str]:
    """'a.b.qkv_proj.weight' -> ('a.b.', 'qkv_proj', 'weight')."""
    head, module, leaf = name.rsplit(".", 2) if name.count(".") >= 2 else ("", *name.split("."))
    return (head + "." if head else ""), module, leaf


EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _experts(name: str) -> tuple[str, str] | None:
    """'…experts.gate_up_proj' -> ('…experts.', 'gate_up_proj'); None if not stacked experts.
    (Quantized experts' '…experts.gate_up_proj_scale' -> the same.)"""
    head, _, leaf = name.rpartition(".")
    for suffix in ("_scale", "_offset"):
        if leaf.endswith(suffix) and leaf[: -len(suffix)] in EXPERTS:
            leaf = leaf[: -len(suffix)]
    if head.endswith("experts") and leaf in EXPERTS:
        return head + ".", leaf
    return None


def _expert_sources(name: str, num_experts: int) -> tuple[str, ...]:
    prefix, leaf = _experts(name)
    mixtral = "block_sparse_moe." in prefix
    return tuple(f"{prefix}{e}.{MIXTRAL_EXPERTS[src] if mixtral else src}.weight"
                 for e in range(num_experts) for src in EXPERTS[leaf])


def checkpoint_names(name: str, shape: tuple[int, ...] = ()) -> tuple[str, ...]:
    """The checkpoint tensors parameter `name` (of logical shape `shape`) is built from
    (itself when not fused)."""
    if _experts(name):
        return _expert_sources(name, shape[0])
    if name.endswith(TIED_LM_HEAD):
        return (name[: -len("lm_weight")] + "weight",)
    if name.count(".") < 1:
        return (name,)
    prefix, module, leaf = _split(name)
    if module not in FUSED:
        return (name,)
    return tuple(f"{prefix}{src}.{leaf}" for src in FUSED[module])


def source_shape(name: str, source: str, fused_shape: tuple[int, ...],
                 head_dim: int) -> tuple[int, ...]:
    """Expected shape (our [in, out] layout) of checkpoint tensor `source` of fused `name`."""
    if _experts(name):  # one expert's [in, out]: [H, I] (gate, up) or [I, H] (down)
        return (fused_shape[1], fused_shape[-1])
    _, module, leaf = _split(name)
    if module == "gate_up_proj":  # weight [in, 2, I]
        return (fused_shape[0], fused_shape[2])
    kv_heads, width = fused_shape[-2], fused_shape[-1]
    q_width = width - 2 * head_dim
    out = kv_heads * (q_width if source.endswith("q_proj." + leaf) else head_dim)
    return (fused_shape[0], out) if leaf == "weight" else (out,)


def fuse(name: str, parts: list[np.ndarray], head_dim: int) -> np.ndarray:
    """The fused parameter from its checkpoint tensors, each already in our layout ([in, out]
    weights, [out] biases) and shape-checked."""
    if _experts(name):
        per = len(EXPERTS[_experts(name)[1]])  # tensors per expert: 2 (gate, up) or 1
        experts = [parts[i:i + per] for i in range(0, len(parts), per)]
        if per == 2:
            return np.stack([np.stack(p, axis=1) for p in experts])  # [E, H, 2, I]
        return np.stack([p[0] for p in experts])  # [E, I, H]
    _, module, leaf = _split(name)
    if module == "gate_up_proj":
        return np.stack(parts, axis=1)  # [in, 2, I]
    q, k, v = parts
    kv_heads = k.shape[-1] // head_dim
    lead = q.shape[:-1]  # (in,) for the weight, () for the bias
    q = q.reshape(*lead, kv_heads, -1)  # [.., Hkv, G*D]: the group of each KV head
    k = k.reshape(*lead, kv_heads, head_dim)
    v = v.reshape(*lead, kv_heads, head_dim)
    return np.concatenate([q, k, v], axis=-1)


def logical_shape(var) -> tuple[int, ...]:
    """A parameter's shape in our [in, out] layout (packed weights: what they pack from)."""
    return tuple(getattr(var, "unpacked_shape", None) or var.shape)


def to_param_layout(var, value: np.ndarray) -> np.ndarray:
    """value in the [in, out] layout -> the parameter's own (column panels if packed)."""
    if getattr(var, "unpacked_shape", None) is None:
        return value
    from jaxinfer.layers.cpu_kernels import pack

    if getattr(var, "stacked_experts", False):  # each expert packed on its own
        return np.stack([pack(w.reshape(w.shape[0], -1)) for w in value])
    return pack(value.reshape(value.shape[0], -1))
