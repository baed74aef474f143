"""Weight restore at start-up: the HF safetensors path we load from today vs a converted-model
cache (issue 29), each in a fresh process (the files in the page cache: a warm restart):

  hf_safetensors  load_model(): HF tensors by name, transposed to our [in, out] layout, cast,
                  placed on the device (what every start does today);
  orbax           the converted nnx state saved once with orbax's StandardCheckpointer and
                  restored into the abstract state's shardings;
  converted_mmap  the converted state saved once as a safetensors file of our layout,
                  memory-mapped (safe_open, numpy) and placed with one device_put per tensor.

Each row: seconds from the start of the restore call to every parameter ready on the device,
the mean of --reps alternated runs. Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/weight_restore.py [--reps 3]
      [--output-json benchmarks/results/weight_restore_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _child(method: str, model_dir: str, work: str) -> float:
    import jax
    import numpy as np
    from flax import nnx

    from jaxinfer.models.loader import build_model, load_model

    if method == "hf_safetensors":
        t0 = time.perf_counter()
        model, _, _ = load_model(model_dir, dtype="float32")
        jax.block_until_ready(nnx.state(model))
        return time.perf_counter() - t0
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    graphdef, abstract = nnx.split(nnx.eval_shape(build_model(cfg, dtype="float32",
                                                              attention_backend="xla")))
    if method == "orbax":
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
            nnx.to_pure_dict(abstract))
        restored = ocp.StandardCheckpointer().restore(os.path.join(work, "orbax"), target)
        jax.block_until_ready(restored)
        return time.perf_counter() - t0
    from safetensors import safe_open

    t0 = time.perf_counter()
    flat = {}
    with safe_open(os.path.join(work, "converted.safetensors"), framework="numpy") as f:
        for name in f.keys():
            flat[name] = jax.device_put(np.asarray(f.get_tensor(name)))
    jax.block_until_ready(flat)
    return time.perf_counter() - t0


def _prepare(model_dir: str, work: str) -> None:
    """The converted state, saved once both ways."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxinfer.models.loader import load_model

    model, _, _ = load_model(model_dir, dtype="float32")
    state = nnx.to_pure_dict(nnx.state(model))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(work, "orbax"), state)
    ckpt.wait_until_finished()
    flat = {".".join(map(str, k)): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(state)[0]
            for k in [[getattr(p, "key", getattr(p, "idx", p)) for p in k]]}
    save_file(flat, os.path.join(work, "converted.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--output-json", default=os.path.join(HERE, "results",
                                                         "weight_restore_cpu.json"))
    args = p.parse_args()
    from jaxinfer.checkpoints.default_model import ensure_default_model

    model_dir = args.model or ensure_default_model()
    work = tempfile.mkdtemp(prefix="jaxinfer-weights-")
    _prepare(model_dir, work)
    methods = ("hf_safetensors", "orbax", "converted_mmap")
    runs = {m: [] for m in methods}
    env = dict(os.environ, PYTHONPATH=ROOT)
    for _ in range(args.reps):
        for m in methods:
            out = subprocess.run([sys.executable, __file__, "--child", m, model_dir, work],
                                 env=env, capture_output=True, text=True, check=True)
            runs[m].append(float(out.stdout.strip().splitlines()[-1]))
            print(m, runs[m][-1], flush=True)
    result = {"benchmark": "weight_restore", "model": model_dir, "reps": args.reps,
              "seconds": runs, "mean_s": {m: sum(v) / len(v) for m, v in runs.items()}}
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["mean_s"]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(_child(*sys.argv[2:5]))
    else:
        main()
