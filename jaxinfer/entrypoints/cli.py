"""`jaxinfer` command line: generate | serve | bench | convert-gguf | prepare-default-model."""

from __future__ import annotations

import argparse
import sys


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


def build_parser() -> argparse.ArgumentParser:
    from jaxinfer.config.cli import add_engine_args, json_object
    from jaxinfer.entrypoints.openai.tools import TOOL_PARSERS

    p = argparse.ArgumentParser(prog="jaxinfer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for prompts (offline)")
    g.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable); default: a handful of built-in questions")
    g.add_argument("--raw", action="store_true",
                   help="use prompts as raw text (default: wrap each in the chat template)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    # Every engine option (EngineConfig's fields: config/cli.py), with generate's defaults.
    add_engine_args(g, defaults={"max_model_len": 1024, "max_num_seqs": 8, "seed": None})
    g.set_defaults(func=_cmd_generate)

    b = sub.add_parser("bench", help="benchmarks: latency | throughput | serve | roofline | "
                       "startup | sweep")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from jaxinfer.bench import auto_tune, offline, roofline, serve, startup, sweep

    offline.add_parsers(bsub)
    startup.add_parser(bsub)
    serve.add_parser(bsub)
    roofline.add_parser(bsub)
    sweep.add_parser(bsub)
    auto_tune.add_parser(sub)
    b.set_defaults(func=lambda a: (a.bench(a), 0)[1])

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    v.add_argument("model", nargs="?", default=None, help="HF folder (default: embedded SmolLM2)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                   "(or set JAXINFER_API_KEY)")
    v.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) requests may use (vLLM's); responses and metrics "
                   "use the first (default: the model folder's name)")
    v.add_argument("--responses-store-size", type=int, default=1024,
                   help="responses kept in memory for /v1/responses' previous_response_id and "
                   "GET /v1/responses/{id} (oldest dropped first; 0: none)")
    v.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                   help="larger request bodies get 413 (default 8 MiB)")
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
    v.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   help='template variables every chat request gets, as JSON, e.g. '
                        '\'{"enable_thinking": false}\' (a request\'s chat_template_kwargs '
                        'override them)')
    v.add_argument("--chat-template", default=None,
                   help="a jinja chat template (a file, or the template itself) used instead "
                        "of the model's")
    v.add_argument("--chat-template-content-format", default="auto",
                   choices=["auto", "string", "openai"],
                   help="how a message's content reaches the template: string (text parts "
                        "joined; what auto does) or openai (a list of {type, text} parts)")
    v.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image_url parts may name file:// images inside this folder (off by "
                        "default; http(s) image URLs are never fetched: send data: URLs)")
    v.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent with a request (it is code: refused by "
                        "default, as in vLLM)")
    v.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served under their own model names (needs "
                        "--enable-lora): name=path, or a JSON object {\"name\", \"path\", "
                        "\"base_model_name\"} (vLLM's forms); loaded at start-up")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice="auto"); needs '
                        "--tool-call-parser")
    v.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                   help="how tool calls look in the model's text (tool_choice=auto)")
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
    # Every engine option (EngineConfig's fields: config/cli.py); the model is positional.
    add_engine_args(v, skip=("model",))
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
