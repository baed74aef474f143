"""The one attention entry point and its metadata (the device contract of ARCHITECTURE.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config.quant import QMAX  # (the formats' largest values: one table)
from pallas_kernels.reference import ragged_paged_attention_reference, write_kv_reference

# "cpu": the C++ FFI kernel (the default on CPU, layers/cpu_kernels.py); "xla": cost follows
# the real work (the default elsewhere, and the CPU fallback); "pallas": the Triton kernel (GPU;
# interpret mode on CPU); "reference": pure jnp, slow on purpose, the ground truth of the tests.
# "auto" is resolved per device by the worker (runner/worker.py) before a model is built.
from jaxinfer.config import ATTENTION_BACKENDS  # noqa: E402  (one list, in the config)
DEFAULT_BACKEND = "xla"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs; every field is a device array of a bucketed shape."""

    slot_mapping: jax.Array  # int32 [T]: cache slot of each token (padding -> null block 0)
    block_tables: jax.Array  # int32 [R, max_blocks]: block ids of each sequence
    seq_lens: jax.Array  # int32 [R]: KV length of each sequence including this step's tokens
    query_start_loc: jax.Array  # int32 [R+1]: offsets of each sequence's tokens in the batch
    num_seqs: jax.Array  # int32 [1]: real sequences; rows past it are padding
    # int32 [1]: sequences [0, num_decodes) have one query token each (the runner lays single-
    # token sequences out first); the xla backend batches them. 0 is always correct, if slower.
    num_decodes: jax.Array
    # int32 [T]: each token's LoRA adapter slot (-1: the base model), read by the linear
    # layers' adapters (layers/lora.py); None when the engine serves no LoRA.
    lora_slots: jax.Array | None = None
    # int32 [T, 2]: (lo, hi) KV positions each token sees beyond the causal ones (Gemma 3's
    # bidirectional attention over an image's tokens; hi < lo: none), in the steps of such a
    # model whose chunks hold images; None in every other step.
    attn_spans: jax.Array | None = None
    # Models with sliding and full layers: the sliding layers' own slot mapping [T] and block
    # tables [R, max_blocks] in their pool (core/window_blocks.py); None otherwise.
    window_slot_mapping: jax.Array | None = None
    window_block_tables: jax.Array | None = None

    def for_sliding_layer(self) -> "AttentionMetadata":
        """What a sliding-window layer reads: its own pool's slots and tables, if it has one."""
        if self.window_block_tables is None:
            return self
        return dataclasses.replace(self, slot_mapping=self.window_slot_mapping,
                                   block_tables=self.window_block_tables)


def check_backend(backend: str) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend={backend!r} is not supported "
            f"(supported: {', '.join(ATTENTION_BACKENDS)})"
        )
    return backend


FP8_MAX = {jnp.dtype(name): QMAX[name] for name in ("float8_e4m3fn", "float8_e5m2")}


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_MAX


def quantize_kv(x, scale, dtype):
    """x / scale, saturated to the fp8 format's range, in `dtype` (what an fp8 cache holds;
    vLLM's scaled conversion saturates the same way)."""
    m = FP8_MAX[jnp.dtype(dtype)]
    return jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)


def write_kv(k_cache, v_cache, k, v, md: AttentionMetadata, kv_scales=None):
    """Scatter this step's k, v [T, Hkv, D] into the caches at md.slot_mapping (fp8 caches:
    k / k_scale and v / v_scale, saturated)."""
    fp8 = is_fp8(k_cache.dtype)
    if fp8:
        ks, vs = kv_scales if kv_scales is not None else (1.0, 1.0)
        k, v = quantize_kv(k, ks, k_cache.dtype), quantize_kv(v, vs, v_cache.dtype)
    if jax.default_backend() == "cpu":
        from jaxinfer.layers import cpu_kernels

        if cpu_kernels.available():
            # One call copying the step's rows in place, whatever the caches' type. XLA:CPU
            # has no fp8 scatter (it would widen the whole cache to float and back around
            # it); a float scatter lowers to a dynamic slice and a dynamic-update-slice per
            # cache, four small ops a layer that cost more to launch than their rows to move
            # (~1 ms of a batch-1 step's trace on a 2-core VM; the end-to-end gain was within
            # that VM's noise).
            return cpu_kernels.write_kv_cpu(k_cache, v_cache, k.astype(k_cache.dtype),
                                            v.astype(v_cache.dtype), md.slot_mapping)
    if fp8:  # the scatter on the caches' bytes (a bitcast of an fp8 cache is a copy on CPU)
        u8 = jnp.uint8
        bits = jax.lax.bitcast_convert_type
        kc, vc = write_kv_reference(bits(k_cache, u8), bits(v_cache, u8), bits(k, u8),
                                    bits(v, u8), md.slot_mapping)
        return bits(kc, k_cache.dtype), bits(vc, v_cache.dtype)
    return write_kv_reference(k_cache, v_cache, k, v, md.slot_mapping)


def attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
              backend: str = DEFAULT_BACKEND, sliding_window: int | None = None, sinks=None):
    """q [T, Hq, D] over the paged caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D].
    sinks: float32 [Hq] attention sinks (gpt-oss: a learned logit per head in the softmax
    denominator), or None."""
    if backend == "auto":  # (engines resolve it per device first; this is for bare models)
        from jaxinfer.layers import cpu_kernels

        cpu = jax.default_backend() == "cpu" and cpu_kernels.available()
        backend = "cpu" if cpu else "xla"
    spans = md.attn_spans
    if backend == "cpu" and spans is not None:
        # (the C++ kernel is causal only: a step with bidirectional image spans, a prefill
        # chunk holding a Gemma 3 image, runs on the XLA path)
        backend = "xla"
    if backend == "xla":
        from jaxinfer.layers.ragged_attention import ragged_paged_attention_xla

        return ragged_paged_attention_xla(
            q, k_cache, v_cache, md.seq_lens, md.block_tables, md.query_start_loc, md.num_seqs,
            md.num_decodes, sm_scale=sm_scale, sliding_window=sliding_window, sinks=sinks,
            spans=spans,
        )
    if backend == "cpu":
        from jaxinfer.layers.cpu_kernels import ragged_paged_attention_cpu

        return ragged_paged_attention_cpu(
            q, k_cache, v_cache, md.seq_lens, md.block_tables, md.query_start_loc, md.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, sinks=sinks,
        )
    if backend == "reference":
        return ragged_paged_attention_reference(
            q, k_cache, v_cache, md.seq_lens, md.block_tables, md.query_start_loc, md.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, sinks=sinks, spans=spans,
        )
    if backend == "pallas":
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        return ragged_paged_attention(
            q, k_cache, v_cache, md.seq_lens, md.block_tables, md.query_start_loc, md.num_seqs,
            sinks, spans, sm_scale=sm_scale, sliding_window=sliding_window,
            interpret=jax.default_backend() == "cpu",
        )
    raise ValueError(check_backend(backend))


def paged_attention(q, k, v, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                    backend: str, sliding_window: int | None, mesh=None, kv_scales=None,
                    sinks=None):
    """Write this step's k, v [T, Hkv, D] into the caches, then attend with q [T, Hq, D].

    fp8 caches hold k / k_scale and v / v_scale (kv_scales: float32 scalars, per layer; None:
    1.0); every backend reads them widened to q's dtype, and the scales come back outside the
    kernels: q . (k_cache * ks) = (q * ks) . k_cache, and the output times vs. sinks: float32
    [Hq] attention sinks, or None.

    With a mesh, both run per device on its own heads (jax.shard_map): no communication.
    A sliding-window layer of a model whose sliding layers have a pool of their own reads that
    pool's slots and tables (AttentionMetadata.for_sliding_layer)."""
    if sliding_window is not None:
        md = md.for_sliding_layer()
    fp8 = is_fp8(k_cache.dtype)
    if fp8 and kv_scales is None:
        kv_scales = (jnp.float32(1.0), jnp.float32(1.0))
    if not fp8:
        kv_scales = None

    def local(q, k, v, k_cache, v_cache, md, kv_scales, sinks):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, md, kv_scales)
        if kv_scales is not None:
            q = (q.astype(jnp.float32) * kv_scales[0]).astype(q.dtype)
        o = attention(q, k_cache, v_cache, md, sm_scale=sm_scale, backend=backend,
                      sliding_window=sliding_window, sinks=sinks)
        if kv_scales is not None:
            o = (o.astype(jnp.float32) * kv_scales[1]).astype(o.dtype)
        return o, k_cache, v_cache

    if mesh is None:
        return local(q, k, v, k_cache, v_cache, md, kv_scales, sinks)
    from jax.sharding import PartitionSpec as P

    from jaxinfer.parallel import ATTN_Q_SPEC, KV_CACHE_SPEC

    md_spec = jax.tree.map(lambda _: P(), md)
    scale_spec = jax.tree.map(lambda _: P(), kv_scales)
    sink_spec = P(ATTN_Q_SPEC[1])  # (split as q's heads)
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(ATTN_Q_SPEC, ATTN_Q_SPEC, ATTN_Q_SPEC, KV_CACHE_SPEC, KV_CACHE_SPEC, md_spec,
                  scale_spec, sink_spec),
        out_specs=(ATTN_Q_SPEC, KV_CACHE_SPEC, KV_CACHE_SPEC), check_vma=False,
    )(q, k, v, k_cache, v_cache, md, kv_scales, sinks)


def paged_latent_attention(q, latent, cache, md: AttentionMetadata, *, sm_scale: float,
                           backend: str, mesh=None):
    """Multi-head latent attention (DeepSeek's MLA, absorbed form) as multi-query attention
    over the one latent cache: write this step's latents [T, Hc, L] into `cache` [num_blocks,
    block_size, Hc, L], then attend with q [T, H, L] using the cache as keys and as values (the
    caller keeps the values' part of the output). Returns (o [T, H, L], the cache). Hc is 1,
    or under tensor parallelism (a mesh) one copy of the latent per device: each device
    attends with its query heads over its own full copy (no communication; splitting the
    latent instead would need the scores summed across devices)."""
    def local(q, latent, cache, md):
        nb, bs, heads, width = cache.shape
        cache = cache.reshape(nb * bs, heads, width).at[md.slot_mapping].set(
            latent.astype(cache.dtype)).reshape(nb, bs, heads, width)
        return attention(q, cache, cache, md, sm_scale=sm_scale, backend=backend), cache

    if mesh is None:
        return local(q, latent, cache, md)
    from jax.sharding import PartitionSpec as P

    from jaxinfer.parallel import ATTN_Q_SPEC, KV_CACHE_SPEC

    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(ATTN_Q_SPEC, ATTN_Q_SPEC, KV_CACHE_SPEC, jax.tree.map(lambda _: P(), md)),
        out_specs=(ATTN_Q_SPEC, KV_CACHE_SPEC), check_vma=False)(q, latent, cache, md)
