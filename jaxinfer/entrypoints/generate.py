"""`jaxinfer generate`: offline generation for a handful of prompts, with tokens/s."""

from __future__ import annotations

import time

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clean Python code.",
    "Explain in two sentences why the sky is blue.",
    "What is 12 times 12?",
    "Name three primary colours.",
]


def run_generate(args) -> int:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.config.cli import engine_config_from_args

    t0 = time.perf_counter()
    llm = LLM.from_engine_config(engine_config_from_args(args))
    eng = llm.llm_engine
    stats = eng.get_stats()
    print(f"loaded {eng.model_dir} ({eng.model_config.architecture}, {eng.dtype}, attention "
          f"{eng.attention_backend}, {stats['num_kv_blocks']} KV blocks, "
          f"{stats['num_compilations']} compiled buckets) in {time.perf_counter() - t0:.1f}s")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    prompts = args.prompt or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    if args.raw:
        outs = llm.generate(prompts, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        print(f"\n### {p}\n{c.text.strip()}\n[{len(c.token_ids)} tokens, {c.finish_reason}]")
    print(f"\n{len(outs)} requests, {n_in} prompt + {n_out} generated tokens in {dt:.2f}s: "
          f"{n_out / dt:.1f} output tok/s, {(n_in + n_out) / dt:.1f} total tok/s "
          f"(compilation included: {eng.get_stats()['compile_seconds']:.1f}s of compiling in all)")
    return 0
