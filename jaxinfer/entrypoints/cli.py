"""`jaxinfer` command line: generate | serve | bench | convert-gguf | prepare-default-model."""

from __future__ import annotations

import argparse
import sys

from jaxinfer.config.engine import ATTENTION_BACKENDS


def _cmd_prepare(args) -> int:
    from jaxinfer.checkpoints.default_model import ensure_default_model

    print(ensure_default_model(verbose=True))
    return 0


def _cmd_convert(args) -> int:
    from jaxinfer.checkpoints.gguf_convert import GGUFConversionError, convert_gguf

    try:
        print(convert_gguf(args.file, args.out_dir))
    except GGUFConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_generate(args) -> int:
    from jaxinfer.entrypoints.generate import run_generate

    return run_generate(args)


def _cmd_serve(args) -> int:
    from jaxinfer.entrypoints.launcher import needs_launcher, run_launcher
    from jaxinfer.entrypoints.serve import run_server

    if needs_launcher(args):  # several API servers, ranks on other hosts, or engines only
        return run_launcher(args)
    return run_server(args)


def _json_arg(text: str):
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _add_ep_sp_args(p) -> None:
    """Expert and sequence parallelism flags (generate and serve)."""
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: experts split over the tensor-parallel "
                        "devices (E / tp whole experts each) instead of every expert split")
    p.add_argument("--enable-sequence-parallelism", action="store_true",
                   help="tensor parallelism: the residual stream split by tokens between "
                        "the tensor-parallel regions (reduce-scatter / all-gather)")


def build_parser() -> argparse.ArgumentParser:
    from jaxinfer.config.engine import add_compilation_args, add_quantization_args

    p = argparse.ArgumentParser(prog="jaxinfer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for prompts (offline)")
    g.add_argument("--model", default=None, help="HF model folder (default: embedded SmolLM2)")
    g.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable); default: a handful of built-in questions")
    g.add_argument("--raw", action="store_true",
                   help="use prompts as raw text (default: wrap each in the chat template)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto")
    add_quantization_args(g)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--max-num-seqs", type=int, default=8)
    g.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS))
    g.add_argument("--no-warmup", action="store_true", help="compile buckets lazily")
    add_compilation_args(g)
    g.add_argument("--async-scheduling", action="store_true",
                    help="dispatch step N+1 before reading step N's tokens (host/device overlap)")
    g.add_argument("--speculative-config", type=_json_arg, default=None,
                   help='speculative decoding, as JSON (vLLM\'s names): {"method": "ngram", '
                        '"num_speculative_tokens": K, "prompt_lookup_min": N, '
                        '"prompt_lookup_max": N}')
    g.add_argument("--kv-transfer-config", type=_json_arg, default=None,
                   help='a KV connector, as JSON (as for serve), e.g. {"kv_connector": '
                        '"SharedStorageConnector", "kv_role": "kv_both", '
                        '"kv_connector_extra_config": {"shared_storage_path": DIR}}')
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core processes the prompts are balanced over")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    _add_ep_sp_args(g)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="decoder layers split over this many stages, each on its own devices")
    g.set_defaults(func=_cmd_generate)

    b = sub.add_parser("bench", help="benchmarks: latency | throughput | serve | roofline | "
                       "startup | sweep")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from jaxinfer.bench import offline, roofline, serve, startup, sweep

    offline.add_parsers(bsub)
    startup.add_parser(bsub)
    serve.add_parser(bsub)
    roofline.add_parser(bsub)
    sweep.add_parser(bsub)
    sweep.add_auto_tune_parser(sub)
    b.set_defaults(func=lambda a: (a.bench(a), 0)[1])

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    v.add_argument("model", nargs="?", default=None, help="HF folder (default: embedded SmolLM2)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                   "(or set JAXINFER_API_KEY)")
    v.add_argument("--served-model-name", default=None)
    v.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                   help="larger request bodies get 413 (default 8 MiB)")
    v.add_argument("--dtype", default="auto")
    add_quantization_args(v)
    v.add_argument("--max-model-len", type=int, default=None)
    v.add_argument("--max-num-seqs", type=int, default=64)
    v.add_argument("--max-num-batched-tokens", type=int, default=None)
    v.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS))
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-warmup", action="store_true", help="compile buckets lazily")
    add_compilation_args(v)
    v.add_argument("--async-scheduling", action="store_true",
                    help="dispatch step N+1 before reading step N's tokens (host/device overlap)")
    v.add_argument("--max-waiting-requests", type=int, default=None,
                   help="at most this many sequences waiting for their first token; more get "
                        "429 with Retry-After (default: no limit)")
    v.add_argument("--queue-timeout", type=float, default=None,
                   help="seconds a request may wait for its first token before it is aborted "
                        "with 503 (default: no limit)")
    v.add_argument("--max-prompts-per-request", type=int, default=None,
                   help="the most prompts one /v1/completions request may carry (default "
                        "1024, or JAXINFER_MAX_PROMPTS_PER_REQUEST); prompts x n is also "
                        "capped by JAXINFER_MAX_N_SEQUENCES (16384)")
    v.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="when the engine core dies, keep the server up answering 503 (for "
                        "debugging; default: exit non-zero once requests in flight are "
                        "answered, so that a supervisor restarts it; or set "
                        "JAXINFER_KEEP_ALIVE_ON_ENGINE_DEATH=1)")
    v.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent with a request (it is code: refused by "
                        "default, as in vLLM)")
    v.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: requests with a lower `priority` field run first")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice="auto"); needs '
                        "--tool-call-parser")
    v.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls look in the model's text (tool_choice=auto)")
    v.add_argument("--structured-outputs-config", type=_json_arg, default=None,
                   help='structured outputs, as JSON: {"backend": "auto" | "guidance" | '
                        '"xgrammar", "disable_any_whitespace": bool, '
                        '"disable_additional_properties": bool, "compile_timeout_s": float}')
    v.add_argument("--speculative-config", type=_json_arg, default=None,
                   help='speculative decoding, as JSON (vLLM\'s names): {"method": "ngram", '
                        '"num_speculative_tokens": K, "prompt_lookup_min": N, '
                        '"prompt_lookup_max": N}')
    v.add_argument("--kv-transfer-config", type=_json_arg, default=None,
                   help='a KV connector, as JSON (vLLM\'s names): {"kv_connector": '
                        '"JaxTransferConnector" | "SharedStorageConnector", "kv_role": '
                        '"kv_producer" | "kv_consumer" | "kv_both", "kv_load_failure_policy": '
                        '"recompute" | "fail", "kv_ip": ..., "kv_connector_extra_config": '
                        '{"shared_storage_path": DIR, "abort_timeout": s, "pull_timeout": s}}')
    v.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core processes (data-parallel ranks), each with "
                        "--tensor-parallel-size devices of its own; one front end balances "
                        "requests over them")
    v.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="ranks on this node (default: all of them); the others come from "
                        "--headless nodes")
    v.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="first rank of a --headless node")
    v.add_argument("--data-parallel-address", "-dpa", default=None,
                   help="the head node's address (default 127.0.0.1)")
    v.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=13345,
                   help="the head's handshake port for ranks on other nodes")
    v.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=["mp", "ray"],
                   help="start the ranks as local processes (mp) or as Ray actors on the "
                        "Ray cluster (ray; `pip install jaxinfer[ray]`)")
    v.add_argument("--headless", action="store_true",
                   help="start engine cores only, for the head at --data-parallel-address")
    v.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="API-server processes sharing --port (each talks to every rank)")
    v.add_argument("--no-data-parallel-prefix-affinity", action="store_true",
                   help="route by load only (default: prompts sharing their first blocks go "
                        "to the rank that has them cached, unless it is much busier)")
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    _add_ep_sp_args(v)
    v.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="decoder layers split over this many stages (each on "
                        "--tensor-parallel-size devices of its own), that many batches in "
                        "flight; JAXINFER_PP_LAYER_PARTITION='4,4,5,3' sets the split")
    v.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 128 on CPU, as vLLM's CPU backend; 16 "
                        "on GPUs)")
    v.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache size in blocks (default: from the memory budget)")
    v.add_argument("--no-enable-prefix-caching", action="store_true",
                   help="turn automatic prefix caching off")
    v.set_defaults(func=_cmd_serve)

    from jaxinfer.entrypoints import disagg_proxy

    disagg_proxy.add_parser(sub)

    c = sub.add_parser("convert-gguf", help="convert a Llama-family GGUF into an HF folder")
    c.add_argument("file")
    c.add_argument("out_dir")
    c.set_defaults(func=_cmd_convert)

    d = sub.add_parser("prepare-default-model", help="convert the embedded SmolLM2 once")
    d.set_defaults(func=_cmd_prepare)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
