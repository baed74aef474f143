"""`jaxinfer generate`: load the model and predict the next token of each prompt.

(The engine issue replaces this with full generation through LLMEngine.)
"""

from __future__ import annotations

import time

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three primary colours are",
]


def run_generate(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.default_model import ensure_default_model
    from jaxinfer.models.loader import load_model
    from jaxinfer.runner.kv_cache import allocate_kv_caches
    from jaxinfer.runner.step_inputs import make_step_inputs
    from jaxinfer.layers.attention import AttentionMetadata
    from jaxinfer.tokenizer import Tokenizer

    model_dir = args.model or ensure_default_model(verbose=True)
    t0 = time.perf_counter()
    model, cfg, dtype = load_model(model_dir, dtype=args.dtype,
                                   attention_backend=args.attention_backend)
    tok = Tokenizer.from_pretrained(model_dir)
    print(f"loaded {model_dir} ({cfg.architecture}, {dtype}) in {time.perf_counter() - t0:.1f}s")
    block_size = 16
    for prompt in args.prompt or DEFAULT_PROMPTS:
        ids = tok(prompt)["input_ids"]
        num_blocks = -(-len(ids) // block_size)
        inp = make_step_inputs([ids], [0], [list(range(1, num_blocks + 1))],
                               block_size=block_size, num_tokens_padded=len(ids),
                               num_reqs_padded=1, max_blocks=num_blocks)
        kv = allocate_kv_caches(cfg, num_blocks + 1, block_size, jnp.dtype(dtype))
        md = AttentionMetadata(*(jnp.asarray(getattr(inp, f)) for f in (
            "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "num_seqs")))
        hidden, _ = model(jnp.asarray(inp.input_ids), jnp.asarray(inp.positions), kv, md)
        logits = np.asarray(model.compute_logits(hidden[-1:]))[0]
        nxt = int(logits.argmax())
        print(f"{prompt!r} -> next token {nxt} {tok.decode([nxt])!r}")
    return 0
