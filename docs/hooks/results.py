"""mkdocs hook: measured results as tables generated from benchmarks/results/*.json at build
time, never copied by hand. A page writes `{{ results("compare_cpu_intel.json") }}` (a path
under benchmarks/results/) where the table goes, or `{{ results_index() }}` for every results
file with its command. Benchmarks with a table of their own have a renderer below; any other
file is rendered generically (its lists of records as tables, its scalars as a list)."""

from __future__ import annotations

import glob
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
_CALL = re.compile(r"\{\{ *results\(\"([^\"]+)\"\) *\}\}")
_INDEX = re.compile(r"\{\{ *results_index\(\) *\}\}")


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v[:8]) + (" ..." if len(v) > 8 else "")
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _source(name: str, d: dict) -> str:
    bits = [f"`benchmarks/results/{name}`"]
    for key in ("command", "commands"):
        if d.get(key):
            cmd = d[key] if isinstance(d[key], str) else "; ".join(map(str, d[key]))
            bits.append(f"command: `{cmd}`")
    for key in ("machine", "environment", "device", "cpus"):
        if d.get(key):
            v = d[key]
            bits.append(f"{key}: " + (", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
                                      if isinstance(v, dict) else _fmt(v)))
    return "*" + "; ".join(bits) + "*"


def _compare_cpu(d: dict) -> str:
    parts = []
    env = d.get("environment", {})
    if env.get("cpu") or d.get("repeats"):  # (runs from 2026-11-26 on say which CPU, and
        # report the median of alternated rounds)
        parts.append(f"{d.get('model', 'SmolLM2-135M-Instruct')} ({d.get('weights', '')}, "
                     f"{d.get('dtype', 'float32')}), "
                     f"{env.get('cpus')} cores of {env.get('cpu')}; median of "
                     f"{d.get('repeats', 1)} alternated rounds")
    for w in d["workloads"]:
        res, ratio = d["results"].get(w, {}), d["jaxinfer_over_peer"].get(w, {})
        n, i, o = w.split("x")
        rows = [[eng, r.get("output_tok_s"), r.get("batch_ttft_s"), r.get("decode_ms_per_token"),
                 f"{ratio[eng]:.2f}x" if eng in ratio else "-",
                 r.get("output_tok_s_runs", "-")] for eng, r in res.items()]
        rows += [[f"{eng}: llama-bench tg{o}", r["llama_bench_tg_tok_s"], "-",
                  r["llama_bench_decode_ms_per_token"], "-", "-"]
                 for eng, r in res.items() if "llama_bench_tg_tok_s" in r]
        parts.append(f"**{n} requests x {i} prompt / {o} output tokens**\n\n" + _table(
            ["engine", "output tok/s", "batch TTFT s", "decode ms/token",
             "jaxinfer / engine", "every run's tok/s"], rows))
    return "\n\n".join(parts)


def _bench_defaults(d: dict) -> str:
    w = d["workload"]
    first = next(iter(d["median_output_tok_s"]))
    rows = [[e, m, f"{d['ratio_to_first'][e]:.2f}x",
             [r["output_tok_s"] for r in d["runs"][e]],
             d["runs"][e][0].get("steps", "-")] for e, m in d["median_output_tok_s"].items()]
    return (f"{w['num_prompts']} x {w['input_len']}/{w['output_len']} random, {d['dtype']}, "
            f"{d['cpus']} cores of {d['cpu']}\n\n" + _table(
                ["command", "median output tok/s", f"{first} / it", "every run",
                 "steps of the first run"], rows))


def _quantization(d: dict) -> str:
    rows = []
    for mode, m in d["modes"].items():
        w = m.get("workloads", {})
        rows.append([mode, m["weight_bytes"] / 2**20, m["num_kv_blocks"],
                     w.get("1x128x128", {}).get("decode_ms_per_token"), m["decode_floor_ms"],
                     w.get("32x128x128", {}).get("output_tok_s"), m.get("agree_first_token"),
                     m.get("agree_all_16")])
    peer = d.get("llama_cpp") or {}
    if peer:  # llama.cpp on the same GGUF file, in the same run
        p32 = peer.get("32x128x128", {})
        rows.append(["llama.cpp (same GGUF)", "-", "-",
                     peer.get("1x128x128", {}).get("decode_ms_per_token"), "-",
                     p32["output_tokens"] / p32["elapsed_s"] if "elapsed_s" in p32
                     else "failed", "-", "-"])
    return _table(["mode", "weights MiB", "KV blocks", "batch 1 ms/token",
                   "weight-read floor ms", "32 x 128 output tok/s",
                   "first token = float32's", "all 16 tokens = float32's"], rows)


def _startup(d: dict) -> str:
    rows = []
    for mode in d.get("modes", []):
        r = d[mode]
        key = "total_s" if mode == "llm" else "first_completion_s"
        rows.append([mode, r["cold_avg"].get(key), len(r["cold"]), r["warm_avg"].get(key),
                     len(r["warm"]), r["cold_avg"].get("num_compilations")])
    return _table(["mode", "cold s (to the first token)", "runs", "warm s", "runs",
                   "compilations (cold)"], rows)


def _kernels(d: dict) -> str:
    rows = []
    for r in d["rows"]:
        sdpa = r.get("torch_sdpa_s")
        rows.append([r["mode"], r["batch"], r["ctx"], r["pallas_s"] * 1e3,
                     None if sdpa is None else sdpa * 1e3,
                     None if sdpa is None else f"{r['pallas_s'] / sdpa:.2f}x",
                     r["kv_bytes"] / r["pallas_s"] / 1e12, r["hbm_floor_s"] * 1e3])
    head = (f"{d['device']}, jax {d['jax']}; measured copy bandwidth "
            f"{d['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, bf16 matmul "
            f"{d['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    return head + "\n\n" + _table(["mode", "batch", "context", "Pallas ms", "torch SDPA ms",
                                   "Pallas / SDPA", "KV TB/s", "HBM floor ms"], rows)


def _generic(d) -> str:
    if not isinstance(d, dict):
        return f"```\n{json.dumps(d, indent=1)[:2000]}\n```"
    parts, scalars = [], []
    for key, v in d.items():
        if key in ("command", "commands", "machine", "environment", "device", "cpus"):
            continue
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            cols = []
            for x in v:
                cols += [k for k, y in x.items() if not isinstance(y, (dict, list))
                         and k not in cols]
            cols = cols[:10]
            parts.append(f"`{key}`\n\n" + _table(cols, [[x.get(c) for c in cols] for x in v]))
        elif isinstance(v, dict):
            flat = _flatten(v, key)
            if flat:
                parts.append(_table(["field", "value"], flat[:40]))
        else:
            scalars.append([key, v])
    if scalars:
        parts.insert(0, _table(["field", "value"], scalars))
    return "\n\n".join(parts)


def _flatten(v, prefix: str) -> list[list]:
    out = []
    if isinstance(v, dict):
        for k, x in v.items():
            out += _flatten(x, f"{prefix}.{k}")
    elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        for i, x in enumerate(v):
            out += _flatten(x, f"{prefix}[{i}]")
    else:
        out.append([prefix, v])
    return out


def _lora(d: dict) -> str:
    res = d["results"]
    engines = list(res)
    scenarios = [s for s in ("base", "lora-none", "1x-r8", "4x-r8", "1x-r16", "4x-r16")
                 if any(s in res[e] for e in engines)]
    rows = []
    for s in scenarios:
        row = [s]
        for e in engines:
            r = res[e].get(s)
            row += [r["output_tok_s"], f"{r['cost_vs_base']:.2f}x", r["runs"]] if r else \
                ["-", "-", "-"]
        if len(engines) == 2 and all(s in res[e] for e in engines):
            row.append(f"{res[engines[0]][s]['output_tok_s'] / res[engines[1]][s]['output_tok_s']:.2f}x")
        rows.append(row)
    header = ["scenario"]
    for e in engines:
        header += [f"{e} tok/s", f"{e} cost (base / it)", f"{e} every run"]
    if len(engines) == 2:
        header.append(f"{engines[0]} / {engines[1]}")
    return (f"{d['workload']} (requests x prompt x output), greedy, float32, {d['cores']} "
            f"cores of {d['cpu']}; median of {d['repeats']} alternated rounds\n\n"
            + _table(header, rows))


def _rl_weights(d: dict) -> str:
    ops = [("update_hf_numpy", "update_weights, HF names, numpy (converted + placed)"),
           ("update_engine_arrays", "update_weights, engine layout, sharded jax.Arrays (no copy)"),
           ("update_engine_numpy", "update_weights, engine layout, numpy (placed)"),
           ("update_from_path", "update_weights_from_path (read + convert + place)"),
           ("update_from_path_core_process", "the same, engine core in its own process"),
           ("update_from_transfer_core_process",
            "update_weights_from_transfer, core in its own process (offer + pull + convert)"),
           ("sleep1", "sleep(level=1)"), ("wake1", "wake_up()"),
           ("sleep2", "sleep(level=2)"),
           ("wake2", "wake_up(weights) + update_weights + wake_up(kv_cache)")]
    res = d["results"]
    header = ["ms (median)"] + [f"{r['model']} ({r['dtype']}, "
                                f"{r['weight_bytes'] / 2**20:.0f} MiB weights)" for r in res]
    rows = []
    for key, label in ops:
        row = [label]
        for r in res:
            v = r["seconds"].get(key) or r.get(key)
            row.append(f"{v['median'] * 1e3:.1f}" if v else "-")
        rows.append(row)
    rows.append(["device bytes freed by sleep(1) / sleep(2), MiB"]
                + [f"{min(r['sleep1_freed_bytes']) / 2**20:.0f} / "
                   f"{min(r['sleep2_freed_bytes']) / 2**20:.0f}" for r in res])
    rows.append(["arrays taken without a copy (engine layout)"]
                + [f"{r['update_engine_arrays_taken']} of "
                   f"{r['update_engine_arrays_taken'] + r['update_engine_arrays_copied']}"
                   for r in res])
    note = "; ".join(f"{k}: {v}" for k, v in d.get("not_measured", {}).items())
    return (f"{d['cpu']}, median of {d['repeats']} runs each (every run in the JSON)\n\n"
            + _table(header, rows) + (f"\n\nNot measured: {note}." if note else ""))


def _embeddings(d: dict) -> str:
    table = d["median_embeddings_per_s"]
    engines = [e for e in ("jaxinfer", "hf", "vllm") if e in table]
    names = {"jaxinfer": "jaxinfer", "hf": "HF transformers", "vllm": "vLLM CPU"}
    header = ["workload"] + [f"{names[e]} emb/s" for e in engines] + [
        f"jaxinfer / {names[e]}" for e in engines if e != "jaxinfer"]
    rows = []
    for w, spec in d["workloads"].items():
        row = [f"{spec['inputs']} x {spec['tokens_each']} tokens"]
        row += [f"{table[e][w]:.1f}" for e in engines]
        row += [f"{table['jaxinfer'][w] / table[e][w]:.2f}x" for e in engines
                if e != "jaxinfer"]
        rows.append(row)
    return (f"{d['cpu']} ({d['ncpu']} cores), {d['model']} {d['dtype']}, {d['pooling']}; "
            f"median of {d['repeats']} rounds (every run in the JSON)\n\n"
            + _table(header, rows))


def _mla_step(d: dict) -> str:
    m, kb = d["model"], d["kv_bytes_per_token"]
    head = (f"{d['environment'].get('cpu')} ({d['environment'].get('cpus')} cores), "
            f"DeepSeek-V3-shaped dummy model: {m['num_hidden_layers']} layers, hidden "
            f"{m['hidden_size']}, {m['num_attention_heads']} heads, latent {m['kv_lora_rank']} + "
            f"{m['qk_rope_head_dim']}, {m['n_routed_experts']} experts (top "
            f"{m['num_experts_per_tok']}), {d['params_total'] / 1e6:.0f} M parameters "
            f"({d['params_active'] / 1e6:.0f} M active), float32, `{d['attention_backend']}` "
            "attention")
    kv = [["this model (float32)", kb["latent_bytes"], kb["full_kv_bytes"],
           f"{kb['compression']:.1f}x"]]
    kv += [[f"{name} widths (bf16)", r["latent_bytes"], r["full_kv_bytes"],
            f"{r['compression']:.1f}x"] for name, r in d["real_models_bf16"].items()]
    steps = [[case, f"{s * 1e3:.1f}"] for case, s in d["step_s"].items()]
    return (head + "\n\n" + _table(["KV bytes per token", "latent", "full K/V", "smaller by"],
                                    kv)
            + "\n\n" + _table(["step", "ms"], steps))


def _window_kv(d: dict) -> str:
    env, med, ratio = d["environment"], d["median"], d["window_over_one_pool"]
    head = (f"{env.get('cpu')} ({env.get('cpus')} cores), {d['model']}; KV budget "
            f"{d['kv_cache_memory_bytes'] / (1 << 30):.2g} GiB; {d['workload']}; median of "
            f"{d['repeats']} alternated rounds")
    keys = ["full_layer_blocks", "window_blocks", "most_running", "preemptions",
            "output_tok_s"]
    rows = [[name.replace("_", " ")] + [med[name][k] for k in keys]
            for name in ("one_pool", "window_pool")]
    rows.append(["window pool / one pool", f"{ratio['full_layer_blocks']:.2f}x", "", "", "",
                 f"{ratio['output_tok_s']:.2f}x"])
    real = [[name, r["one_pool_bytes"] / (1 << 20), r["window_pool_bytes"] / (1 << 20),
             f"{r['ratio']:.2f}x"] for name, r in d["analytical_bf16_32k"].items()]
    return (head + "\n\n"
            + _table(["", "full layers' blocks", "sliding pool's blocks", "most running",
                      "preemptions", "output tok/s"], rows)
            + "\n\n" + _table(["a 32k-token request, bf16 (the released widths)",
                                "one pool, MiB", "with the sliding pool, MiB", "smaller by"], real))


def _vision_prefill(d: dict) -> str:
    env, v, t = d["environment"], d["model"]["vision_config"], d["model"]["text_config"]
    head = (f"{env.get('cpu')} ({env.get('cpus')} cores), float32, "
            f"`{env.get('step_compilation')}` steps; tower: "
            f"{v.get('depth', v.get('num_hidden_layers'))} blocks of width "
            f"{v['hidden_size']}; language model: {t['num_hidden_layers']} layers of width "
            f"{t['hidden_size']}; input image {d['image_pixels'][0]} x {d['image_pixels'][1]} "
            f"({d['image_tokens']} tokens), prompt {d['prompt_tokens']} tokens; median of "
            "the runs")
    r = d["request_ms"]
    rows = [[f"encoder alone (one image: {d['encoder_gflop']:.0f} GFLOP at "
             f"{d['encoder_gflop_per_s']:.0f} GFLOP/s)", d["encoder_ms"], "-"],
            ["request, a new image", r["image_miss"], "1.00x"],
            ["request, the same image again (encoder cache hit)", r["image_hit"],
             f"{r['image_hit'] / r['image_miss']:.2f}x"],
            ["request, text only, same length", r["text_only"],
             f"{r['text_only'] / r['image_miss']:.2f}x"]]
    first = d.get("first_run_ms") or {}
    if "encoder" in first:
        rows.append(["first image of this size: the tower's compile on top",
                     first["encoder"] - d["encoder_ms"], "-"])
    if "request_image" in first:
        rows.append(["first request with an image: the steps' image variant on top",
                     first["request_image"] - r["image_miss"], "-"])
    return head + "\n\n" + _table(["what", "ms", "vs a new image"], rows)


def _vision_serve(d: dict) -> str:
    head = (f"{d.get('cpu')} ({d.get('cpus')} cores): {d['num_prompts']} chat requests, "
            f"random text and images {d['buckets']} (one per request), max concurrency "
            f"{d['max_concurrency']}; `{d['server']}`")
    rows = [["completed / failed", f"{d['completed']} / {d['failed']}"],
            ["images, input tokens, output tokens",
             f"{d['total_images']}, {d['total_input_tokens']}, {d['total_output_tokens']}"],
            ["requests/s", d["request_throughput"]], ["output tok/s", d["output_throughput"]],
            ["TTFT median / p99 ms", f"{d['ttft_ms']['median']:.1f} / {d['ttft_ms']['p99']:.1f}"],
            ["TPOT median ms", d["tpot_ms"]["median"]]]
    return head + "\n\n" + _table(["", ""], rows)


def _cpu_kernels_avx2(d: dict) -> str:
    """The C++ kernels before / after on one machine: each cell the range over the runs."""
    runs = d["runs"]

    def spread(vals, fmt):
        lo, hi = min(vals), max(vals)
        return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"

    def matmul(when, variant, metric, rows):  # (when "": every run)
        return [r[metric][str(rows)] for k, run in runs.items()
                if k.startswith(f"matmul_{when}") for r in run["results"]
                if r["variant"] == variant]

    def attention(when, case):
        return [run["results"][case]["ms_30_layers"] for k, run in runs.items()
                if k.startswith(f"attention_{when}")]

    f1 = "{:.1f}".format  # noqa: E731
    f0 = "{:.0f}".format  # noqa: E731
    rows = [["packed matmul, 1 row"] + [spread(matmul(w, v, "weight_gb_per_s", 1), f1) + " GB/s"
                                        for w, v in (("before", "packed kernel"),
                                                     ("after", "packed kernel"),
                                                     ("", "xla dot"))]]
    for n in (32, 256):
        rows.append([f"packed matmul, {n} rows"] + [
            spread(matmul(w, v, "gflops", n), f0) + " GFLOP/s"
            for w, v in (("before", "packed kernel"), ("after", "packed kernel"),
                         ("", "xla dot"))])
    rows.append(["attention, decode 32 x 256"] + [
        spread(attention(w, "decode-32@256"), f0) + " ms" for w in ("before", "after")] + [""])
    rows.append(["attention, prefill 2 x 1024"] + [
        spread([x / 1e3 for x in attention(w, "prefill-2x1024")], f1) + " s"
        for w in ("before", "after")] + [""])
    return (f"{d['machine']}: {d['note']}\n\n"
            + _table(["30 layers of SmolLM2 shapes", "before", "after",
                      "XLA's dot, every run and flag variant"], rows))


def _before_after(d: dict) -> str:
    """Measurements taken on one machine before and after a change, runs alternated: the
    median of each side, after / before, and every run."""
    import statistics

    rows = []
    for r in d["rows"]:
        b, a = statistics.median(r["before"]), statistics.median(r["after"])
        # (step_pair.py: the median of each round's ratio, its two turns side by side)
        ratio = r.get("paired_after_over_before", a / b)
        rows.append([r["measure"], f"{b:.4g} {r['unit']}", f"{a:.4g} {r['unit']}",
                     f"{ratio:.3f}", r["before"], r["after"]])
    return (f"{d['note']}\n\n" + _table(
        ["measure", f"before ({d['before_rev']})", f"after ({d['after_rev']})",
         "after / before", "before runs", "after runs"], rows))


def _gemm_vs_onednn(d: dict) -> str:
    """Our bf16 kernel against vLLM's oneDNN matmul per shape and row count, paired turns."""
    rows = [[f"{r['model']} {r['projection']} ({r['K']} x {r['N']})", r["M"],
             f"{r['ours_gflops']:.1f}", f"{r['onednn_gflops']:.1f}",
             f"{r['ours_over_onednn']:.2f}x", ", ".join(f"{x:.2f}" for x in r["rounds"])]
            for r in d["results"]]
    note = d.get("note", "")
    return (f"{note}\n\n" if note else "") + _table(
        ["shape (K x N)", "M", "ours GFLOP/s", "oneDNN GFLOP/s", "ours / oneDNN",
         "rounds"], rows)


def _thread_cpu(d: dict) -> str:
    """CPU ms per output token by kind of thread, one column per mode
    (benchmarks/thread_cpu.py)."""
    modes = [r["mode"] + (f" {r['options']}" if r.get("options") else "") for r in d["rows"]]
    kinds = []
    for r in d["rows"]:
        kinds += [k for k in r["cpu_ms_per_token"] if k not in kinds]
    rows = [["wall ms per output token"] + [r["wall_ms_per_token"] for r in d["rows"]],
            ["CPU ms per output token, all threads"]
            + [r["cpu_ms_per_token_total"] for r in d["rows"]]]
    rows += [[f"CPU ms: {k}"] + [r["cpu_ms_per_token"].get(k, "") for r in d["rows"]]
             for k in kinds if any(r["cpu_ms_per_token"].get(k) for r in d["rows"])]
    rows.append(["CPU use (CPU / (wall x cores))"] + [r["cpu_use"] for r in d["rows"]])
    return (f"{d['workload']} ({d['dtype']}), {len(d['rows'][0]['run_seconds'])} timed runs "
            "per mode\n\n" + _table(["per output token"] + modes, rows))


RENDERERS = {"compare_cpu": _compare_cpu, "thread_cpu": _thread_cpu, "before_after": _before_after,
             "gemm_vs_onednn": _gemm_vs_onednn,
             "mla_step": _mla_step, "quantization": _quantization, "startup": _startup,
             "kernels": _kernels, "bench_defaults": _bench_defaults, "lora": _lora,
             "rl_weights": _rl_weights, "embeddings": _embeddings,
             "vision_prefill": _vision_prefill, "vision_serve": _vision_serve,
             "cpu_kernels_avx2": _cpu_kernels_avx2, "window_kv": _window_kv}


def render(name: str) -> str:
    path = os.path.join(RESULTS, name)
    with open(path) as f:
        d = json.load(f)
    kind = d.get("benchmark") if isinstance(d, dict) else None
    body = RENDERERS.get(kind, _generic)(d)
    return f"{body}\n\n{_source(name, d) if isinstance(d, dict) else ''}\n"


def render_index() -> str:
    rows = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "**", "*.json"), recursive=True)):
        name = os.path.relpath(path, RESULTS)
        with open(path) as f:
            d = json.load(f)
        d = d if isinstance(d, dict) else {}
        cmd = d.get("command") or ""
        rows.append([f"`{name}`", d.get("benchmark", ""), f"`{cmd}`" if cmd else ""])
    return _table(["file", "benchmark", "command"], rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _INDEX.sub(lambda m: render_index(), markdown)
    return _CALL.sub(lambda m: render(m.group(1)), markdown)
