"""PyTorch baselines on the same workloads as `jaxinfer bench throughput` / `latency`.

  --mode static      HF transformers `generate` over static, left-padded batches
  --mode continuous  HF transformers' own continuous-batching path (`generate_batch`), where
                     the installed version has it

Writes the same JSON schema as jaxinfer's throughput benchmark (plus "baseline"). Greedy, EOS
ignored (min_new_tokens = max_new_tokens), so every request produces exactly its output length.
Usage:
  python benchmarks/baselines/hf_transformers.py --model DIR --dataset random --num-prompts 64 \
      --input-len 512 --output-len 256 --mode static --batch-size 32 --output-json F
"""

from __future__ import annotations

import argparse
import platform
import time


def main(argv=None) -> dict:
    import torch
    import transformers

    from jaxinfer.bench import write_result
    from jaxinfer.bench.datasets import add_dataset_args, load_requests
    from jaxinfer.config import ModelConfig
    from jaxinfer.checkpoints.default_model import ensure_default_model
    from jaxinfer.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", default="static", choices=["static", "continuous"])
    ap.add_argument("--batch-size", type=int, default=32)
    add_dataset_args(ap, num_prompts=64, input_len=512, output_len=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)

    model_dir = args.model or ensure_default_model()
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    tok = Tokenizer.from_pretrained(args.tokenizer or model_dir) if args.dataset == "sharegpt" \
        else None
    reqs = load_requests(args, tok, vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    if args.load_format == "dummy":
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    pad = 0

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    if args.mode == "static" and reqs:  # warm-up (one-time allocations), untimed
        with torch.no_grad():
            model.generate(torch.tensor([reqs[0].prompt_token_ids], device=device),
                           do_sample=False, max_new_tokens=2, pad_token_id=pad)
    n_out = 0
    t0 = time.perf_counter()
    if args.mode == "static":
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt_token_ids))
        for s in range(0, len(order), args.batch_size):
            batch = [reqs[i] for i in order[s : s + args.batch_size]]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):
                ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids):] = 1
            new = max(r.output_len for r in batch)
            with torch.no_grad():
                model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                               max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)
            n_out += sum(r.output_len for r in batch)  # tokens the workload asked for
    else:
        if not hasattr(model, "generate_batch"):
            raise SystemExit("this transformers version has no continuous batching")
        new = max(r.output_len for r in reqs)
        gen_cfg = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new,
                                                do_sample=False, eos_token_id=None,
                                                pad_token_id=pad)
        with torch.no_grad():
            model.generate_batch([r.prompt_token_ids for r in reqs], generation_config=gen_cfg)
        n_out = sum(r.output_len for r in reqs)
    sync()
    elapsed = time.perf_counter() - t0
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    result = {"benchmark": "throughput", "baseline": f"hf-transformers-{args.mode}",
              "dataset": args.dataset, "num_requests": len(reqs), "total_prompt_tokens": n_in,
              "total_output_tokens": n_out, "elapsed_time": elapsed,
              "requests_per_second": len(reqs) / elapsed,
              "tokens_per_second": (n_in + n_out) / elapsed,
              "output_tokens_per_second": n_out / elapsed,
              "batch_size": args.batch_size if args.mode == "static" else None,
              "note": "static batches generate max(output_len) per batch; only the requested "
                      "tokens are counted",
              "environment": {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                              "transformers": transformers.__version__, "device": device,
                              "dtype": args.dtype, "python": platform.python_version()}}
    print(f"[{result['baseline']}] {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    return write_result(args.output_json, result)


if __name__ == "__main__":
    main()
