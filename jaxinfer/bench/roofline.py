"""Roofline numbers for a model config on a device: what the hardware allows, next to measured.

Decode-step floor = (weight bytes + KV bytes read) / measured HBM bandwidth;
prefill floor = FLOPs / measured dense bf16 (or fp32 on CPU) matmul rate.
"""

from __future__ import annotations

import time

from jaxinfer.bench import write_result
from jaxinfer.config import ModelConfig


def param_count(cfg: ModelConfig) -> dict[str, int]:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    attn = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h
    if cfg.attention_bias:
        attn += cfg.q_size + 2 * cfg.kv_size
    layer = attn + 3 * h * i + 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    embed = v * h
    lm_head = 0 if cfg.tie_word_embeddings else v * h
    return {"embedding": embed, "layers": layer * cfg.num_hidden_layers, "lm_head": lm_head,
            "final_norm": h, "total": embed + layer * cfg.num_hidden_layers + lm_head + h}


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def decode_step_floor_s(cfg: ModelConfig, dtype_bytes: int, batch: int, context: int,
                        bandwidth: float) -> float:
    """One decode step reads every weight once (the embedding only for `batch` rows) and the
    KV of batch x context tokens."""
    p = param_count(cfg)
    weights = (p["total"] - p["embedding"] + (p["embedding"] if cfg.tie_word_embeddings else 0))
    weight_bytes = weights * dtype_bytes
    return (weight_bytes + batch * context * kv_bytes_per_token(cfg, dtype_bytes)) / bandwidth


def prefill_flops(cfg: ModelConfig, num_tokens: int, context: int = 0) -> float:
    """2 * params per token for the matmuls (logits for the last token only) + attention."""
    p = param_count(cfg)
    dense = 2 * (p["layers"]) * num_tokens + 2 * cfg.vocab_size * cfg.hidden_size
    avg_kv = context + num_tokens / 2
    attn = 4 * cfg.num_hidden_layers * num_tokens * avg_kv * cfg.num_attention_heads \
        * cfg.head_dim
    return float(dense + attn)


def measure_device(dtype: str = "bfloat16", size: int = 4096) -> dict[str, float]:
    """Measured copy bandwidth (bytes/s, read+write) and dense matmul rate (FLOP/s)."""
    import jax
    import jax.numpy as jnp

    def best(fn, *a):
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return min(ts)

    on_gpu = jax.default_backend() == "gpu"
    n_bytes = (1 << 30) if on_gpu else (1 << 26)
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    bw = 2 * n_bytes / best(jax.jit(lambda a: a * 1.0), x)
    n = size if on_gpu else 1024
    dt = jnp.dtype(dtype if on_gpu else "float32")
    a = jnp.ones((n, n), dt)
    rate = 2 * n ** 3 / best(jax.jit(lambda p, q: p @ q), a, a)
    return {"copy_bandwidth_bytes_per_s": bw, "matmul_flops_per_s": rate,
            "matmul_dtype": dt.name, "device": jax.devices()[0].device_kind}


def run_roofline(args) -> dict:
    from jaxinfer.models.default_model import ensure_default_model

    cfg = ModelConfig.from_pretrained(args.model or ensure_default_model())
    dev = measure_device(args.dtype)
    dtype_bytes = 2 if args.dtype in ("bfloat16", "float16") else 4
    p = param_count(cfg)
    rows = []
    for b in args.batch_sizes:
        floor = decode_step_floor_s(cfg, dtype_bytes, b, args.context,
                                    dev["copy_bandwidth_bytes_per_s"])
        rows.append({"batch": b, "context": args.context, "decode_step_floor_s": floor,
                     "decode_tokens_per_s_ceiling": b / floor})
    pf = prefill_flops(cfg, args.prefill_tokens)
    result = {"benchmark": "roofline", "architecture": cfg.architecture, "params": p,
              "weight_bytes": p["total"] * dtype_bytes,
              "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype_bytes), "dtype": args.dtype,
              "device": dev, "decode": rows, "prefill_tokens": args.prefill_tokens,
              "prefill_flops": pf, "prefill_floor_s": pf / dev["matmul_flops_per_s"]}
    print(f"{cfg.architecture}: {p['total'] / 1e6:.1f}M params, "
          f"{result['weight_bytes'] / 2**30:.2f} GiB weights ({args.dtype}), "
          f"{result['kv_bytes_per_token'] / 1024:.1f} KiB KV per token")
    print(f"device {dev['device']}: copy {dev['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, "
          f"matmul {dev['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({dev['matmul_dtype']})")
    for r in rows:
        print(f"  decode batch {r['batch']:4} ctx {r['context']:6}: step floor "
              f"{r['decode_step_floor_s'] * 1e3:.3f} ms -> <= "
              f"{r['decode_tokens_per_s_ceiling']:.0f} tok/s")
    print(f"  prefill {args.prefill_tokens} tokens: {pf / 1e12:.2f} TFLOP -> floor "
          f"{result['prefill_floor_s'] * 1e3:.2f} ms")
    return write_result(args.output_json, result)


def add_parser(sub) -> None:
    p = sub.add_parser("roofline", help="hardware floors for a model on this device")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 8, 32, 256])
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--output-json", default=None)
    p.set_defaults(bench=run_roofline)
