"""Roofline numbers for a model on a device: what the hardware allows, next to measured.

Both rates are measured here by probes, not assumed: memory bandwidth by streaming a 256 MiB
(GPU: 1 GiB) array, read only (a sum: what a decode step does to weights and KV) and read+write
(a copy), matmul rate by a dense matmul (bf16 on GPU, fp32 on CPU) at a large square shape and
at the decode shape [batch, hidden] x [hidden, intermediate]. Decode-step floors: bandwidth =
(weight bytes + KV bytes read) / read bandwidth; compute = the step's FLOPs / matmul rate; the
step cannot beat the larger. With --measure (default) the engine's own
decode step is timed at each batch size (prompts of --context tokens, then --decode-steps
steps) and printed beside its floors, with the fraction of the floor reached.
Prefill floor = FLOPs / matmul rate.
"""

from __future__ import annotations

import argparse
import time

from jaxinfer.bench import write_result
from jaxinfer.config import ModelConfig


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part. Mixture-of-experts models: "layers" counts every expert,
    "active_layers" the router and the num_experts_per_tok experts one token runs through
    (dense models: the two are equal), "expert" one expert's gated MLP, "moe_layers" how
    many layers are sparse."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    if cfg.kv_lora_rank:  # latent attention: q (LoRA or plain), kv_a, its norm, kv_b, o
        nh, lat, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        qk = cfg.qk_nope_head_dim + rope
        ql = cfg.q_lora_rank
        attn = (h * ql + ql + ql * nh * qk if ql else h * nh * qk) + h * (lat + rope) + lat \
            + lat * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) + nh * cfg.v_head_dim * h
    else:
        attn = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h
        if cfg.attention_bias:
            attn += cfg.q_size + 2 * cfg.kv_size
        if cfg.o_proj_bias:
            attn += h
        if cfg.attention_sinks:
            attn += cfg.num_attention_heads
    base = attn + (4 if cfg.sandwich_norms else 2) * h + (2 * cfg.head_dim if cfg.qk_norm
                                                          else 0)
    expert = 3 * h * cfg.moe_intermediate_size
    if cfg.moe_expert_bias:
        expert += 2 * cfg.moe_intermediate_size + h
    shared = (3 * h * cfg.shared_expert_intermediate_size + h
              if cfg.shared_expert_intermediate_size else 0)  # (+ its gate)
    shared += 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts  # (DeepSeek's)
    layers = active = moe_layers = 0
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            moe_layers += 1
            router = h * cfg.num_experts
            if cfg.moe_router_bias or cfg.moe_scoring == "sigmoid":  # (a bias per expert;
                # DeepSeek-V3's is its correction bias)
                router += cfg.num_experts
            layers += base + router + cfg.num_experts * expert + shared
            active += base + router + cfg.num_experts_per_tok * expert + shared
        else:
            layers += base + 3 * h * i
            active += base + 3 * h * i
    embed = v * h
    lm_head = 0 if cfg.tie_word_embeddings else v * h
    return {"embedding": embed, "layers": layers, "active_layers": active, "lm_head": lm_head,
            "final_norm": h, "total": embed + layers + lm_head + h,
            "active": embed + active + lm_head + h, "expert": expert, "moe_layers": moe_layers}


def experts_touched(cfg: ModelConfig, rows: int) -> float:
    """Expected distinct experts a MoE layer runs for `rows` tokens, were routing uniform:
    E * (1 - (1 - k/E)^rows) (a decode step reads only those experts' weights)."""
    if not cfg.num_experts:
        return 0.0
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** rows)


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """K and V of every layer (latent attention: the latent only)."""
    return (cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + cfg.v_cache_dim)
            * dtype_bytes)


def decode_step_floor_s(cfg: ModelConfig, dtype_bytes: int, batch: int, context: int,
                        bandwidth: float) -> float:
    """One decode step reads every weight once (the embedding only for `batch` rows; of a
    mixture-of-experts layer only the experts some row chose, see experts_touched) and the
    KV of batch x context tokens."""
    p = param_count(cfg)
    weights = (p["total"] - p["embedding"] + (p["embedding"] if cfg.tie_word_embeddings else 0))
    weights -= p["moe_layers"] * p["expert"] * (cfg.num_experts - experts_touched(cfg, batch))
    return decode_floor(weights * dtype_bytes, cfg, dtype_bytes, batch, context, bandwidth)


def decode_step_flops(cfg: ModelConfig, batch: int, context: int) -> float:
    """One decode step: 2 * params per row for the matmuls (layers' active parameters + LM
    head) + attention (q.k and p.v over `context` positions, every query head)."""
    p = param_count(cfg)
    dense = 2 * (p["active_layers"] + cfg.vocab_size * cfg.hidden_size) * batch
    attn = 4 * cfg.num_hidden_layers * batch * context * cfg.num_attention_heads * cfg.head_dim
    return float(dense + attn)


def prefill_flops(cfg: ModelConfig, num_tokens: int, context: int = 0) -> float:
    """2 * params per token for the matmuls (logits for the last token only) + attention."""
    p = param_count(cfg)
    dense = 2 * (p["active_layers"]) * num_tokens + 2 * cfg.vocab_size * cfg.hidden_size
    avg_kv = context + num_tokens / 2
    attn = 4 * cfg.num_hidden_layers * num_tokens * avg_kv * cfg.num_attention_heads \
        * cfg.head_dim
    return float(dense + attn)


def _best(fn, *a) -> float:
    """Seconds of fn(*a), the best of 5 after one untimed call."""
    import jax

    jax.block_until_ready(fn(*a))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _probe_bytes() -> int:
    """Larger than any last-level cache, so a probe streams from memory."""
    import jax

    return (1 << 30) if jax.default_backend() == "gpu" else (1 << 28)


def measure_read_bandwidth() -> float:
    """Bytes/s of a sum streaming an array larger than any last-level cache (what a decode step
    does to weights and KV)."""
    import jax
    import jax.numpy as jnp

    n_bytes = _probe_bytes()
    return n_bytes / _best(jax.jit(jnp.sum), jnp.ones((n_bytes // 4,), jnp.float32))


def decode_floor(weight_bytes: int, cfg: ModelConfig, kv_dtype_bytes: int, batch: int,
                 context: int, bandwidth: float) -> float:
    """Seconds a decode step of `batch` rows at `context` tokens cannot beat: the weights as
    held (quantized ones at their own size) and the KV read once."""
    kv = batch * context * kv_bytes_per_token(cfg, kv_dtype_bytes)
    return (weight_bytes + kv) / bandwidth


def measure_device(dtype: str = "bfloat16", size: int = 4096,
                   decode_shape: tuple[int, int, int] | None = None) -> dict[str, float]:
    """Measured read bandwidth (bytes/s, a sum), copy bandwidth (read+write) and dense matmul
    rate (FLOP/s); with decode_shape (m, k, n) also the rate of that (small-m) matmul."""
    import jax
    import jax.numpy as jnp

    best = _best
    on_gpu = jax.default_backend() == "gpu"
    # "+ 1" (not "* 1", which XLA folds away) makes the copy read and write every byte.
    n_bytes = _probe_bytes()
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    bw = 2 * n_bytes / best(jax.jit(lambda a: a + 1.0), x)
    del x
    read_bw = measure_read_bandwidth()
    n = size if on_gpu else 2048
    dt = jnp.dtype(dtype if on_gpu else "float32")
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), dt)
    rate = 2 * n ** 3 / best(jax.jit(lambda p, q: p @ q), a, a)
    out = {"read_bandwidth_bytes_per_s": read_bw, "copy_bandwidth_bytes_per_s": bw,
           "matmul_flops_per_s": rate,
           "matmul_dtype": dt.name, "matmul_probe": [n, n, n],
           "device": jax.devices()[0].device_kind}
    if decode_shape is not None:
        m, k, n2 = decode_shape
        p_, q_ = jax.random.normal(key, (m, k), dt), jax.random.normal(key, (k, n2), dt)
        out["decode_matmul_flops_per_s"] = 2 * m * k * n2 / best(jax.jit(lambda p, q: p @ q),
                                                                 p_, q_)
        out["decode_matmul_probe"] = [m, k, n2]
    return out


def measure_decode_steps(args, batch_sizes) -> dict[int, dict]:
    """The engine's decode step at each batch size: B prompts of args.context random tokens,
    timed to 1 token (prefill) and to 1 + args.decode_steps tokens; step = the difference /
    decode_steps. The host's share (schedule, build, update) is inside, as a user sees it."""
    import numpy as np

    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    max_b = max(batch_sizes)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.context + args.decode_steps + 8,
              max_num_seqs=max_b, max_num_batched_tokens=max(256, max_b),
              warmup_buckets="all")  # (no compiling in the background while it is timed)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    out = {}
    for b in batch_sizes:
        prompts = [{"prompt_token_ids": rng.integers(10, vocab, args.context).tolist()}
                   for _ in range(b)]

        def run(n):
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            return time.perf_counter() - t0

        run(2)  # warm-up
        t1 = min(run(1) for _ in range(2))
        tn = min(run(1 + args.decode_steps) for _ in range(2))
        out[b] = {"step_s": (tn - t1) / args.decode_steps, "attention_backend":
                  llm.llm_engine.attention_backend}
    llm.shutdown()
    return out


def run_roofline(args) -> dict:
    from jaxinfer.checkpoints.default_model import ensure_default_model

    args.model = args.model or ensure_default_model()
    cfg = ModelConfig.from_pretrained(args.model)
    b_mid = max(args.batch_sizes)
    width = cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size
    dev = measure_device(args.dtype, decode_shape=(b_mid, cfg.hidden_size, width))
    dtype_bytes = 2 if args.dtype in ("bfloat16", "float16") else 4
    p = param_count(cfg)
    measured = measure_decode_steps(args, args.batch_sizes) if args.measure else {}
    rows = []
    for b in args.batch_sizes:
        bw_floor = decode_step_floor_s(cfg, dtype_bytes, b, args.context,
                                       dev["read_bandwidth_bytes_per_s"])
        flops = decode_step_flops(cfg, b, args.context)
        compute_floor = flops / dev["matmul_flops_per_s"]
        floor = max(bw_floor, compute_floor)
        row = {"batch": b, "context": args.context, "decode_step_floor_s": bw_floor,
               "decode_step_flops": flops, "compute_floor_s": compute_floor,
               "floor_s": floor, "decode_tokens_per_s_ceiling": b / floor}
        if b in measured:
            m = measured[b]["step_s"]
            row.update(measured_step_s=m, measured_tokens_per_s=b / m,
                       fraction_of_floor=floor / m,
                       attention_backend=measured[b]["attention_backend"])
        rows.append(row)
    pf = prefill_flops(cfg, args.prefill_tokens)
    result = {"benchmark": "roofline", "architecture": cfg.architecture, "params": p,
              "weight_bytes": p["total"] * dtype_bytes,
              "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype_bytes), "dtype": args.dtype,
              "device": dev, "decode": rows, "prefill_tokens": args.prefill_tokens,
              "prefill_flops": pf, "prefill_floor_s": pf / dev["matmul_flops_per_s"]}
    active = (f" ({p['active'] / 1e6:.1f}M active per token: {cfg.num_experts_per_tok} of "
              f"{cfg.num_experts} experts)" if cfg.num_experts else "")
    print(f"{cfg.architecture}: {p['total'] / 1e6:.1f}M params{active}, "
          f"{result['weight_bytes'] / 2**30:.2f} GiB weights ({args.dtype}), "
          f"{result['kv_bytes_per_token'] / 1024:.1f} KiB KV per token")
    print(f"device {dev['device']}: read {dev['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"copy {dev['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"matmul {dev['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s ({dev['matmul_dtype']}, "
          f"{'x'.join(map(str, dev['matmul_probe']))}), at the decode shape "
          f"{'x'.join(map(str, dev['decode_matmul_probe']))}: "
          f"{dev['decode_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s")
    for r in rows:
        line = (f"  decode batch {r['batch']:4} ctx {r['context']:6}: floors bandwidth "
                f"{r['decode_step_floor_s'] * 1e3:.2f} ms, compute "
                f"{r['compute_floor_s'] * 1e3:.2f} ms ({r['decode_step_flops'] / 1e9:.2f} GFLOP)"
                f" -> <= {r['decode_tokens_per_s_ceiling']:.0f} tok/s")
        if "measured_step_s" in r:
            line += (f"; measured step {r['measured_step_s'] * 1e3:.2f} ms "
                     f"({r['measured_tokens_per_s']:.0f} tok/s, {r['fraction_of_floor']:.0%} "
                     f"of the floor, attention {r['attention_backend']})")
        print(line)
    print(f"  prefill {args.prefill_tokens} tokens: {pf / 1e12:.2f} TFLOP -> floor "
          f"{result['prefill_floor_s'] * 1e3:.2f} ms")
    return write_result(args.output_json, result)


def add_parser(sub) -> None:
    p = sub.add_parser("roofline", help="hardware floors for a model on this device")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 32, 256])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=16,
                   help="decode steps timed per batch size (with --measure)")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                   help="time the engine's decode step beside the floors (default on)")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--output-json", default=None)
    p.set_defaults(bench=run_roofline)
