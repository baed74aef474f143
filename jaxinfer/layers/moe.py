"""Mixture-of-experts block (Qwen3-MoE's `mlp`, Mixtral's `block_sparse_moe`).

A router (`gate`, a linear layer to one logit per expert) scores every token; the softmax's
top-k experts each run their gated MLP (down(silu(gate(x)) * up(x))) on the token, and the
outputs are summed, weighted by the router probabilities (renormalised over the k chosen when
`norm_topk_prob`: Mixtral always, Qwen3-MoE per its config).

Grouped computation, never all experts for every token: the T*k (token, expert) pairs are
sorted by expert and each expert's rows multiplied by its own weights, as one grouped matmul
per projection:
- packed float32 / bfloat16 weights (the `cpu` backend): the C++ grouped kernel, which
  streams only the weights of experts some token chose (layers/cpu_kernels.py);
- otherwise `jax.lax.ragged_dot`, which XLA lowers to grouped GEMMs on GPU (on CPU it expands
  to a masked dense product per expert: correct, not fast).
`moe_reference` computes every expert for every token with one-hot weights: the test oracle.

Qwen2-MoE adds a shared expert (a dense gated MLP every token runs), its output scaled by
sigmoid(shared_expert_gate(x)) before it joins the routed experts' sum.

Families vary it without a copy: gpt-oss (models/gpt_oss.py) passes an `Experts` with biases
on both projections, its own activation and its checkpoint's stacked layout, and a biased
router under its own name; DeepSeek-V3 (models/deepseek_v3.py) subclasses SparseMoE for its
router (`route`) and shared experts. The down projections' biases are added once, outside the
per-device partial sums.

Expert weights are stacked: experts.gate_up_proj [E, H, 2, I] (gate, then up) and
experts.down_proj [E, I, H], built at load time from the checkpoint's per-expert tensors
(models/fused.py). Under tensor parallelism each expert is split over I, like the dense MLP.
Quantized experts (fp8 / int8, config/quant.py) hold `gate_up_proj_scale` [E, KB, 2, I] and
`down_proj_scale` [E, KB, H] beside them: the C++ grouped kernel reads them packed with
per-channel scales; elsewhere the step dequantizes the experts before the grouped matmul.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxinfer.layers.linear import GatedMLP, Linear, _initializer, _scale_value
from jaxinfer.layers.params import HF, param, scale_axes


def route(logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int32 [T, k]): softmax over
    all experts in float32, the top k, renormalised to sum 1 when norm_topk_prob."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _expert_weight(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, packed: bool,
                   quant, axes: tuple, hf: HF) -> nnx.Param:
    """Stacked expert weights of logical shape (E, in, *out); packed: each expert's [in, out]
    in column panels, [E, ceil(out/32), in, 32]. Quantized: int8 / fp8 values (dummy: as
    linear.py's)."""
    init = _initializer(rngs, dtype, quant)
    if not packed:
        return param(init(shape), axes=axes, hf=hf)
    from jaxinfer.layers.cpu_kernels import packed_shape

    e, k, n = shape[0], shape[1], math.prod(shape[2:])
    return param(init((e, *packed_shape(k, n))), axes=axes, hf=hf, unpacked_shape=shape,
                 stacked_experts=True)


def _expert_scale(shape: tuple[int, ...], quant, packed: bool, axes: tuple
                  ) -> nnx.Param | None:
    """Scales of quantized stacked experts of logical shape (E, in, *out): (E, KB, *out)
    (KB = 1: per output channel), packed per expert [E, P, KB, 32] when the weights are."""
    if quant is None:
        return None
    kb = 1 if quant.in_block is None else -(-shape[1] // quant.in_block)
    value = _scale_value(quant)
    logical = (shape[0], kb, *shape[2:])
    axes = scale_axes(axes, stacked_experts=True)
    if not packed:
        return param(jnp.full(logical, value, jnp.float32), axes=axes)
    from jaxinfer.layers.cpu_kernels import packed_shape

    return param(jnp.full((shape[0], *packed_shape(kb, math.prod(shape[2:]))), value,
                          jnp.float32), axes=axes, unpacked_shape=logical, stacked_experts=True)


# The checkpoint's per-expert tensors: (gate, up) and (down) of each expert e, under the
# experts module (Qwen-MoE's names; Mixtral's are w1, w3 and w2).
QWEN_EXPERT_NAMES = (("gate_proj", "up_proj"), ("down_proj",))


def _dequantize_experts(w, scale, in_block):
    """Stacked quantized experts [E, in, *out] with scales [E, KB, *out] -> float32."""
    e, k = w.shape[:2]
    out = w.shape[2:]
    w = w.reshape(e, k, -1).astype(jnp.float32)
    s = scale.reshape(e, scale.shape[1], -1).astype(jnp.float32)
    rows = in_block if s.shape[1] > 1 else k
    s = jnp.repeat(s, rows, axis=1, total_repeat_length=s.shape[1] * rows)[:, :k]
    return (w * s).reshape(e, k, *out)


class Experts(nnx.Module):
    """E gated MLPs with their weights stacked (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype,
                 rngs: nnx.Rngs, packed: bool = False, quant=None,
                 hf_names: tuple = QWEN_EXPERT_NAMES, hf_layouts: tuple | None = None,
                 bias: bool = False, act=None):
        """hf_names: the checkpoint's names of each expert's (gate, up) and (down,);
        hf_layouts: instead, the HF layouts of (gate_up_proj, down_proj, and with bias
        gate_up_proj_bias, down_proj_bias) (a family whose checkpoint stacks its experts).
        bias: per-expert biases on both projections (gpt-oss). act: (gate, up) -> the
        projection's input (default: silu(gate) * up)."""
        # (quantized experts are packed for the CPU kernel with per-channel scales only)
        packed = packed and (quant is None or quant.in_block is None)
        self.num_experts, self.intermediate_size, self.packed = (num_experts, intermediate_size,
                                                                 packed)
        self.hidden_size, self.quant, self.dtype = hidden_size, quant, dtype
        gu = (num_experts, hidden_size, 2, intermediate_size)
        dn = (num_experts, intermediate_size, hidden_size)
        gu_axes = ("experts", "embed", None, "expert_mlp")
        dn_axes = ("experts", "expert_mlp", "embed")

        def hf(names):
            return HF(tuple(f"{{module}}.{{e}}.{n}.weight" for n in names), transpose=True,
                      fuse="experts")

        layouts = hf_layouts or (hf(hf_names[0]), hf(hf_names[1]))
        self.gate_up_proj = _expert_weight(rngs, gu, dtype, packed, quant, gu_axes, layouts[0])
        self.down_proj = _expert_weight(rngs, dn, dtype, packed, quant, dn_axes, layouts[1])
        self.act = act
        if bias:
            self.gate_up_proj_bias = param(jnp.zeros((num_experts, 2, intermediate_size), dtype),
                                           axes=("experts", None, "expert_mlp"),
                                           hf=layouts[2])
            self.down_proj_bias = param(jnp.zeros((num_experts, hidden_size), dtype),
                                        axes=("experts", None), hf=layouts[3])
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.gate_up_proj_scale = _expert_scale(gu, quant, packed, gu_axes)
        self.down_proj_scale = _expert_scale(dn, quant, packed, dn_axes)

    def weights(self):
        """(gate_up, down) as the unpacked paths use them: float (quantized experts
        dequantized here, in the step: under a mesh XLA partitions this like any op)."""
        gu, dn = self.gate_up_proj[...], self.down_proj[...]
        if self.quant is None:
            return gu, dn
        block = self.quant.in_block
        return (_dequantize_experts(gu, self.gate_up_proj_scale[...], block).astype(self.dtype),
                _dequantize_experts(dn, self.down_proj_scale[...], block).astype(self.dtype))

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """x [T, H], router weights [T, k] and expert ids int32 [T, k] -> [T, H]."""
        gu_bias = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[...]
        if self.packed:
            scales = ((self.gate_up_proj_scale[...], self.down_proj_scale[...])
                      if self.quant is not None else (None, None))
            out = expert_mlp(x, weights, experts, self.gate_up_proj[...], self.down_proj[...],
                             packed=True, hidden_size=self.hidden_size,
                             intermediate_size=self.intermediate_size, scales=scales,
                             gate_up_bias=gu_bias, act=self.act)
        else:
            gu, dn = self.weights()
            out = expert_mlp(x, weights, experts, gu, dn, packed=False,
                             hidden_size=self.hidden_size,
                             intermediate_size=self.intermediate_size, gate_up_bias=gu_bias,
                             act=self.act)
        return out + self.down_bias_sum(weights, experts, out.dtype)

    def down_bias_sum(self, weights, experts, dtype):
        """The down projections' biases, router-weighted over each token's k experts (added
        once, outside the per-device partial sums of the sharded path); 0 without biases."""
        if self.down_proj_bias is None:
            return jnp.zeros((), dtype)
        b = jnp.take(self.down_proj_bias[...], experts, axis=0)  # [T, k, H]
        return jnp.einsum("tkh,tk->th", b, weights.astype(b.dtype)).astype(dtype)


def _grouped(x, weight, group_sizes, out_features: int, packed: bool, scale=None):
    """rows sorted by expert [M, in] x each group's expert weight -> [M, out_features]."""
    if packed:
        from jaxinfer.layers.cpu_kernels import grouped_matmul

        return grouped_matmul(x, weight, group_sizes, out_features, scale)
    w = weight.reshape(weight.shape[0], x.shape[-1], out_features)
    return jax.lax.ragged_dot(x, w, group_sizes)


def silu_glu(gate, up):
    return jax.nn.silu(gate) * up


def expert_mlp(x, weights, experts, gate_up, down, *, packed: bool, hidden_size: int,
               intermediate_size: int, first_expert=None, scales=(None, None),
               gate_up_bias=None, act=None):
    """The experts held here (gate_up [E_here, H, 2, I_here], down [E_here, I_here, H]; packed:
    their column panels) on the (token, slot) pairs routed to them: x [T, H], weights [T, k],
    experts int32 [T, k] (global ids; with first_expert, only first_expert .. + E_here are
    held here) -> [T, H], the pairs routed elsewhere contributing zero. gate_up_bias
    [E_here, 2, I_here] is added to each row's gate / up by its expert; act(gate, up) (default
    silu(gate) * up) makes the down projection's input. With every expert and all of I here (one
    device) that is the whole block; under tensor / expert parallelism, one device's partial
    sum."""
    t, k = experts.shape
    e_here = gate_up.shape[0]
    key = experts.reshape(-1)  # [T*k]
    if first_expert is not None:  # (expert parallel) other devices' experts sort last
        local = key - first_expert
        here = (local >= 0) & (local < e_here)
        key = jnp.where(here, local, e_here)
    order = jnp.argsort(key, stable=True)  # grouped by expert, tokens in order within
    group_sizes = jnp.bincount(key, length=e_here + 1)[:e_here].astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)  # [T*k, H]
    i = intermediate_size if packed else gate_up.shape[-1]
    gate_up_out = _grouped(rows, gate_up, group_sizes, 2 * i, packed, scales[0])
    gate, up = gate_up_out[:, :i], gate_up_out[:, i:]
    if gate_up_bias is not None:  # each row's expert: rows past the groups take the last
        row_expert = jnp.minimum(jnp.take(key, order), e_here - 1)
        b = jnp.take(gate_up_bias, row_expert, axis=0).astype(gate.dtype)  # [T*k, 2, I]
        gate, up = gate + b[:, 0], up + b[:, 1]
    h = (act or silu_glu)(gate, up)
    y = _grouped(h, down, group_sizes, hidden_size, packed, scales[1])  # [T*k, H]
    # Back to (token, slot) order, then the router-weighted sum over the k slots.
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    y = jnp.take(y, unsort, axis=0).reshape(t, k, -1)
    if first_expert is not None:
        y = jnp.where(here.reshape(t, k, 1), y, 0)  # rows past the groups: not ours
    return jnp.einsum("tkh,tk->th", y, weights.astype(y.dtype))


class SparseMoE(nnx.Module):
    """Router + experts: x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, *, dtype, rngs: nnx.Rngs, packed: bool = False,
                 mesh=None, expert_parallel: bool = False, shared_intermediate_size: int = 0,
                 quant=None, expert_names: tuple = QWEN_EXPERT_NAMES, router_name: str = "gate",
                 router_bias: bool = False, experts: Experts | None = None):
        """router_name: the router's attribute (= checkpoint) name, with a bias when
        router_bias (gpt-oss: `router`, biased); experts: the family's own experts module
        (default: Experts from the arguments above)."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and "
                             f"num_experts={num_experts}")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.mesh, self.expert_parallel = mesh, expert_parallel
        # The router stays unpacked: E logits, small next to the experts.
        self.router_name = router_name
        setattr(self, router_name, Linear(hidden_size, num_experts, use_bias=router_bias,
                                          dtype=dtype, rngs=rngs, axes=("embed", None)))
        self.experts = experts or Experts(num_experts, hidden_size, intermediate_size,
                                          dtype=dtype, rngs=rngs, packed=packed, quant=quant,
                                          hf_names=expert_names)
        # Qwen2-MoE: every token also runs a shared expert, scaled by sigmoid(gate(x)).
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, dtype=dtype,
                                          rngs=rngs, packed=packed)
            self.shared_expert_gate = Linear(hidden_size, 1, use_bias=False, dtype=dtype,
                                             rngs=rngs, axes=("embed", None))
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x: jax.Array, lora_slots=None) -> jax.Array:
        """x [T, H] -> [T, H]. lora_slots: unused: LoRA adapters never reach a mixture-of-
        experts block (the adapter loader refuses ones that target it, lora/adapter.py)."""
        weights, experts = self.route(x)
        if self.mesh is None:
            out = self.experts(x, weights, experts)
        else:
            out = self._sharded(x, weights, experts)
            out = out + self.experts.down_bias_sum(weights, experts, out.dtype)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, H] -> (router weights float32 [T, k], expert ids int32 [T, k]): softmax
        top-k (a family with other routing overrides this)."""
        router = getattr(self, self.router_name)
        return route(router(x), self.top_k, self.norm_topk_prob)

    def _sharded(self, x, weights, experts):
        """Under a mesh, per device (jax.shard_map): tokens and routing are replicated (the
        residual stream is, between layers); each device runs the experts' weights it holds on
        the pairs routed to them, and one all-reduce (psum) sums the partial outputs, as the
        dense MLP's row-parallel down projection does. Tensor parallel: every expert split
        over I. Expert parallel: experts whole, E / tp of them per device. (The all-reduce
        needs no dispatch: with tokens replicated the all-gather of an all-gather +
        reduce-scatter scheme is free; an all-to-all would pay off once tokens are sharded,
        e.g. with data-parallel attention.)"""
        from jaxinfer.parallel import TP, param_spec

        ex = self.experts
        tp = self.mesh.size
        specs = (param_spec(ex.gate_up_proj, tp, self.expert_parallel),
                 param_spec(ex.down_proj, tp, self.expert_parallel))
        e_here = ex.num_experts // self.mesh.size if self.expert_parallel else ex.num_experts
        bias = ex.gate_up_proj_bias
        bias_spec = P() if bias is None else param_spec(bias, tp, self.expert_parallel)

        def local(x, weights, experts, gate_up, down, gate_up_bias):
            first = jax.lax.axis_index(TP) * e_here if self.expert_parallel else None
            y = expert_mlp(x, weights, experts, gate_up, down, packed=False,
                           hidden_size=ex.hidden_size, intermediate_size=0, first_expert=first,
                           gate_up_bias=gate_up_bias, act=ex.act)
            return jax.lax.psum(y, TP)

        return jax.shard_map(local, mesh=self.mesh,
                             in_specs=(P(), P(), P(), *specs, bias_spec), out_specs=P())(
            x, weights, experts, *ex.weights(), None if bias is None else bias[...])


def moe_reference(x, router_w, gate_up, down, top_k: int, norm_topk_prob: bool):
    """Every expert on every token, weighted by the router's (zero off the top k): the dense
    oracle. x [T, H], router_w [H, E], gate_up [E, H, 2, I], down [E, I, H] (unpacked)."""
    weights, experts = route(x @ router_w, top_k, norm_topk_prob)
    e = router_w.shape[1]
    dense_w = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32) * weights[..., None],
                      axis=1)  # [T, E]
    gu = jnp.einsum("th,ehgi->tegi", x, gate_up)
    h = jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]  # [T, E, I]
    y = jnp.einsum("tei,eih->teh", h, down)
    return jnp.einsum("teh,te->th", y, dense_w.astype(y.dtype))
