"""LoRA on the linear layers (multi-LoRA serving, vLLM's punica design on dense ops).

A projection an adapter may target holds `max_loras` device slots of its low-rank factors,
beside its base weight of logical shape [in, *out]:

- lora_a [in, S, P*R]: the shrink factors of every slot (R = max_lora_rank, P = the parts a
  fused projection is made of: 3 for q/k/v, 2 for gate/up, else 1; each part's A in its own
  R columns, zero-padded past the adapter's rank); `in` first, so the shrink is one plain
  matmul [T, in] x [in, S*P*R] (no transposed copy of the factors per step);
- lora_b [S, R, *out]: the expand factors, scaling (lora_alpha / r, or / sqrt(r) with
  rsLoRA) folded in, in the fused output layout: every output column belongs to one part
  (q/k/v: column ranges of each KV head's block), which expands from its part's R columns of
  the shrink; gate/up: [2, S, R, I], a contiguous [S*R, I] expand per part. So the delta
  lands in the fused layout and splits over devices exactly as the base weight does (same
  logical axes), with no zero blocks. Each parameter's `slot_axis` says where its slots are.

Every token carries its request's slot (AttentionMetadata.lora_slots, -1: the base model);
the step computes y += onehot(slot) . (x A_s) B_s for all slots at once: a shrink to S*P*R
columns, masked to each token's slot, and an expand per part. Slots and rank are static
shapes, so loading an adapter into a slot (lora/manager.py) replaces arrays and never
recompiles. The parameters carry `lora=True`: the checkpoint loader leaves them at zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.layers.params import param


def lora_params(lora, in_features: int, out_shape: tuple[int, ...], axes: tuple, parts: int,
                dtype, stacked: bool = False):
    """(lora_a, lora_b) of a projection of logical shape (in, *out_shape) and axes `axes`,
    made of `parts` checkpoint projections (stacked: on out_shape's first axis, gate/up);
    lora = (slots, rank) or None -> (None, None)."""
    if lora is None:
        return None, None
    slots, rank = lora
    a = param(jnp.zeros((in_features, slots, parts * rank), dtype),
              axes=(axes[0], None, None), lora=True, slot_axis=1)
    if stacked:
        b = param(jnp.zeros((out_shape[0], slots, rank, *out_shape[1:]), dtype),
                  axes=(axes[1], None, None, *axes[2:]), lora=True, slot_axis=1)
    else:
        b = param(jnp.zeros((slots, rank, *out_shape), dtype), axes=(None, None, *axes[1:]),
                  lora=True, slot_axis=0)
    return a, b


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
               parts=None) -> jax.Array:
    """x [T, in], a [in, S, P*R], slots int32 [T] (-1 or >= S: no adapter) -> the adapters'
    delta [T, *out] (zero for tokens of the base model). parts: None (one part, b [S, R,
    *out]), "stack" (b [P, S, R, I], part p is out[:, p]: gate/up) or the widths of the
    parts' column ranges along b [S, R, ..., W]'s last axis (q/k/v)."""
    select = jax.nn.one_hot(slots, a.shape[1], dtype=x.dtype)  # [T, S] (all 0 for -1)
    h = jnp.einsum("ti,isw->tsw", x, a.astype(x.dtype)) * select[:, :, None]  # [T, S, P*R]
    b = b.astype(x.dtype)
    if parts is None:
        return jnp.einsum("tsr,sr...->t...", h, b)
    if parts == "stack":
        r = b.shape[2]
        return jnp.stack([jnp.einsum("tsr,sri->ti", h[:, :, p * r:(p + 1) * r], b[p])
                          for p in range(b.shape[0])], axis=1)
    r = b.shape[1]
    outs, start = [], 0
    for p, width in enumerate(parts):
        outs.append(jnp.einsum("tsr,sr...->t...", h[:, :, p * r:(p + 1) * r],
                               b[..., start:start + width]))
        start += width
    return jnp.concatenate(outs, axis=-1)


def add_lora(y: jax.Array, x: jax.Array, module, slots, parts=None) -> jax.Array:
    """y + the module's LoRA delta, when it has slots and the step carries token slots."""
    if slots is None or getattr(module, "lora_a", None) is None:
        return y
    return y + lora_delta(x, module.lora_a[...], module.lora_b[...], slots,
                          parts).astype(y.dtype)
