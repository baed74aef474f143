"""Weight updates and sleep / wake-up of a live engine (issue: RL rollouts), on this machine.

For each model, one engine in this process (enable_multiprocessing=False: update_weights
takes arrays), every operation --repeats times, the median reported (and every run):
  update_hf_numpy      update_weights({HF name: numpy array}) of every tensor of the
                       checkpoint: converted on the host as loading does (fused q/k/v and
                       gate/up, packed for the CPU kernel), then placed
  update_engine_arrays update_weights(layout="engine") with jax.Arrays already sharded as
                       the engine's (what a trainer on the same devices hands over): taken
                       as they are, no copy (num_arrays_taken)
  update_engine_numpy  the same names as numpy arrays: placed (one copy)
  update_from_path     update_weights_from_path(folder): read + convert + place
  sleep1 / wake1       sleep(level=1) (weights copied to host, weights and KV freed) and
                       wake_up(); freed bytes = live device bytes before - after
  sleep2 / wake2       sleep(level=2), wake_up(["weights"]) + update_weights(HF numpy) +
                       wake_up(["kv_cache"])
and, for SmolLM2, through an engine core in its own process (the default multiprocessing
setup): update_from_path (the folder read by the core's process) and update_from_transfer
(this process offers the HF numpy arrays with a WeightSender, the core pulls them over
jax.experimental.transfer and converts them; the offer's time included).
Models: the embedded SmolLM2-135M-Instruct (float32) and a Llama-3.2-1B-shaped model
(bfloat16, random weights written once to a safetensors folder under --work-dir). An
8B-shaped model does not fit this machine's 24 GiB twice over (16 GiB in bfloat16, and an
update holds old and new weights at once): not measured here.
Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/rl_weights.py [--repeats 3]
      [--output-json benchmarks/results/rl_weights_cpu_intel.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.compare_cpu import _cpu_name  # noqa: E402

LLAMA_1B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                torch_dtype="bfloat16")


def make_1b(folder: str) -> str:
    """A Llama-3.2-1B-shaped checkpoint of random bfloat16 weights (written once)."""
    path = os.path.join(folder, "model.safetensors")
    if os.path.isfile(path):
        return folder
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    c = LLAMA_1B
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    rng = np.random.default_rng(0)
    tensors = {k: (rng.standard_normal(s, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
               for k, s in shapes.items()}
    save_file(tensors, path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f)
    return folder


def _median(runs: list[float]) -> dict:
    return {"median": statistics.median(runs), "runs": runs}


def measure(model: str, dtype: str, repeats: int) -> dict:
    """In this process: every operation `repeats` times."""
    import jax
    import numpy as np

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.models.loader import _iter_tensors, _safetensors_index
    from jaxinfer.runner.weights import live_device_bytes

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, enable_multiprocessing=False, enable_sleep_mode=True,
              warmup=False, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              num_kv_blocks=64, skip_tokenizer_init=True)
    start_s = time.perf_counter() - t0
    one = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False)

    def step():
        return llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], one, use_tqdm=False)[0]

    step()
    files = _safetensors_index(model)
    hf = dict(_iter_tensors(files, list(files)))
    mem = llm.llm_engine.engine_core.core.worker.memory
    out: dict = {"model": os.path.basename(os.path.normpath(model)), "dtype": dtype,
                 "start_s": start_s, "weight_bytes": mem["weight_bytes_per_device"],
                 "kv_cache_bytes": mem["kv_cache_bytes_per_device"],
                 "checkpoint_bytes": int(sum(a.nbytes for a in hf.values()))}
    runs: dict[str, list] = {}

    def timed(name, fn):
        t = time.perf_counter()
        result = fn()
        runs.setdefault(name, []).append(time.perf_counter() - t)
        return result

    for _ in range(repeats):
        r = timed("update_hf_numpy", lambda: llm.update_weights(hf))
        out["update_hf_numpy_bytes_placed"] = r["bytes"]
        mine = {k: v * 1 for k, v in llm.collective_rpc("engine_weights")[0].items()}
        jax.block_until_ready(mine)
        r = timed("update_engine_arrays", lambda: llm.update_weights(mine, layout="engine"))
        out["update_engine_arrays_taken"] = r["num_arrays_taken"]
        out["update_engine_arrays_copied"] = r["num_arrays_copied"]
        host = {k: np.array(v, copy=True) for k, v in mine.items()}  # (own memory)
        mine = None  # (the engine holds them now; only its reference keeps them)
        timed("update_engine_numpy", lambda: llm.update_weights(host, layout="engine"))
        host = None
        timed("update_from_path", lambda: llm.update_weights_from_path(model))
        step()
        before = live_device_bytes()
        timed("sleep1", lambda: llm.sleep(1))
        out.setdefault("sleep1_freed_bytes", []).append(before - live_device_bytes())
        timed("wake1", lambda: llm.wake_up())
        step()
        before = live_device_bytes()
        timed("sleep2", lambda: llm.sleep(2))
        out.setdefault("sleep2_freed_bytes", []).append(before - live_device_bytes())
        timed("wake2", lambda: (llm.wake_up(["weights"]), llm.update_weights(hf),
                                llm.wake_up(["kv_cache"])))
        step()
    out["num_compilations"] = llm.llm_engine.engine_core.core.runner.num_compilations
    out["seconds"] = {k: _median(v) for k, v in runs.items()}
    llm.shutdown()
    return out


def measure_mp(model: str, dtype: str, repeats: int) -> dict:
    """update_weights_from_path with the engine core in its own process."""
    from jaxinfer import LLM

    llm = LLM(model, dtype=dtype, warmup=False, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, num_kv_blocks=64, skip_tokenizer_init=True)
    from jaxinfer.models.loader import _iter_tensors, _safetensors_index
    from jaxinfer.weight_transfer import WeightSender

    files = _safetensors_index(model)
    hf = dict(_iter_tensors(files, list(files)))
    sender = WeightSender()
    runs: dict[str, list] = {}
    for _ in range(repeats):
        t = time.perf_counter()
        llm.update_weights_from_path(model)
        runs.setdefault("update_from_path_core_process", []).append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.update_weights_from_transfer(sender.offer(hf))
        runs.setdefault("update_from_transfer_core_process", []).append(
            time.perf_counter() - t)
    llm.shutdown()
    return {k: _median(v) for k, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=os.path.join(ROOT, ".cache", "bench-rl"))
    ap.add_argument("--models", default="smollm2,llama-1b")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "DTYPE", "KIND"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:  # (a child: one model in a fresh process, its JSON on the last line)
        model, dtype, kind = a.one
        res = measure(model, dtype, a.repeats) if kind == "inproc" else \
            measure_mp(model, dtype, a.repeats)
        print(json.dumps(res))
        return
    from jaxinfer.checkpoints.default_model import ensure_default_model

    jobs = []
    if "smollm2" in a.models:
        jobs.append((ensure_default_model(), "float32", ("inproc", "mp")))
    if "llama-1b" in a.models:
        jobs.append((make_1b(os.path.join(a.work_dir, "llama-1b")), "bfloat16", ("inproc",)))
    results = []
    for model, dtype, kinds in jobs:
        res: dict = {}
        for kind in kinds:
            p = subprocess.run([sys.executable, __file__, "--repeats", str(a.repeats), "--one",
                                model, dtype, kind], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=ROOT))
            if p.returncode:
                raise SystemExit(f"{model} {kind} failed:\n{p.stderr[-3000:]}")
            res.update(json.loads(p.stdout.strip().splitlines()[-1]))
        results.append(res)
        s = res["seconds"]
        print(f"{res['model']} ({dtype}, {res['weight_bytes'] / 2**20:.0f} MiB of weights): "
              + ", ".join(f"{k} {v['median'] * 1e3:.1f} ms" for k, v in s.items())
              + "".join(f", {k} {res[k]['median'] * 1e3:.1f} ms" for k in
                        ("update_from_path_core_process", "update_from_transfer_core_process")
                        if k in res), flush=True)
    doc = {"benchmark": "rl_weights", "cpu": _cpu_name(), "repeats": a.repeats,
           "command": "PYTHONPATH=. .venv/bin/python benchmarks/rl_weights.py "
                      + " ".join(sys.argv[1:]),
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results,
           "not_measured": {"8B-shaped": "16 GiB of bfloat16 weights, held twice during an "
                                        "update: over this machine's 24 GiB",
                            "transfer path, other models": "measured for SmolLM2 only"}}
    if a.output_json:
        os.makedirs(os.path.dirname(a.output_json), exist_ok=True)
        with open(a.output_json, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", a.output_json)


if __name__ == "__main__":
    main()
