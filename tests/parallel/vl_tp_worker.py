"""Runs in a subprocess with fake CPU devices: a vision-language engine (the tiny Qwen2.5-VL or
Gemma 3 of tests/models) at one tensor-parallel size generates greedily for prompts with
images; prints the tokens as JSON.

    vl_tp_worker.py MODEL_DIR TP [qwen|gemma]
"""

from __future__ import annotations

import json
import sys


def main():
    model_dir, tp = sys.argv[1], int(sys.argv[2])
    family = sys.argv[3] if len(sys.argv) > 3 else "qwen"
    import jax
    import numpy as np
    from PIL import Image

    jax.config.update("jax_default_matmul_precision", "highest")
    from jaxinfer import LLM, SamplingParams

    gemma = family == "gemma"
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, skip_tokenizer_init=True,
              max_model_len=96, max_num_batched_tokens=24 if gemma else 16, warmup=False,
              num_kv_blocks=17 if gemma else 13, block_size=8, max_num_seqs=4,
              enable_multiprocessing=False)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((56, 56), (84, 112), (56, 84))]
    image, start, end = 190, 188, 189
    if gemma:  # (<start_of_image> alone marks an image)
        image, start, end = 250, 2, 7
    prompts = [
        {"prompt_token_ids": [start, image, end, 5, 6, 7],
         "multi_modal_data": {"image": images[0]}},
        {"prompt_token_ids": [3, 4, start, image, end, 9, start, image, end, 11],
         "multi_modal_data": {"image": images[1:]}},
        {"prompt_token_ids": [8, start, image, end, 5, 6, 7],
         "multi_modal_data": {"image": images[2]}},
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    runner = llm.llm_engine.engine_core.core.runner
    leaves = jax.tree.leaves(runner.mm.tower_state(runner.state.params))
    print(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                     o.outputs[0].logprobs)] for o in outs],
        "tower_replicated": all(x.sharding.is_fully_replicated for x in leaves),
        "devices": min(len(x.sharding.device_set) for x in leaves),
    }))
    llm.shutdown()


def check_tp2_equals_tp1(model_dir: str, family: str) -> None:
    """(In a test) TP=2 on 4 fake CPU devices gives TP=1's tokens and logprobs (within 2e-4),
    the tower replicated on both devices; each run in a subprocess of this script."""
    import os
    import subprocess

    import numpy as np

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}

    def run(tp):
        out = subprocess.run([sys.executable, "tests/parallel/vl_tp_worker.py", model_dir,
                              str(tp), family], cwd=root, env=env, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    base, got = run(1), run(2)
    assert got["tokens"] == base["tokens"]
    np.testing.assert_allclose(np.concatenate(got["logprobs"]),
                               np.concatenate(base["logprobs"]), atol=2e-4)
    assert got["tower_replicated"] and got["devices"] == 2


if __name__ == "__main__":
    main()
