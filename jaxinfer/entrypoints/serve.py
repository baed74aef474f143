"""`jaxinfer serve`: the command line's arguments -> EngineConfig and OpenAIServer, run under
uvicorn (exit code 1 when the engine died, so that a supervisor restarts the server). The
launcher (several API servers, remote or headless ranks) builds its servers with the same
functions."""

from __future__ import annotations

import logging
import os

from jaxinfer.engine.async_engine import AsyncLLM
from jaxinfer.entrypoints.openai.api_server import OpenAIServer
from jaxinfer.entrypoints.openai.serving_responses import DEFAULT_STORE_SIZE

logger = logging.getLogger(__name__)


def engine_config_from_args(args):
    """The engine options of `jaxinfer serve`'s flags (config/cli.py generates them)."""
    from jaxinfer.config.cli import engine_config_from_args as from_args

    return from_args(args)


def make_server(llm: AsyncLLM, args, metrics_role: str = "only") -> OpenAIServer:
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model))
                                      if args.model else "SmolLM2-135M-Instruct")
    keep_alive = (getattr(args, "keep_alive_on_engine_death", False)
                  or os.environ.get("JAXINFER_KEEP_ALIVE_ON_ENGINE_DEATH", "0") not in ("", "0"))
    return OpenAIServer(llm, name, api_key=args.api_key or os.environ.get("JAXINFER_API_KEY"),
                        max_request_body_bytes=args.max_request_body_bytes,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        max_waiting_requests=args.max_waiting_requests,
                        queue_timeout=args.queue_timeout, metrics_role=metrics_role,
                        max_prompts_per_request=getattr(args, "max_prompts_per_request", None),
                        keep_alive_on_engine_death=keep_alive,
                        trust_request_chat_template=getattr(
                            args, "trust_request_chat_template", False),
                        default_chat_template_kwargs=getattr(
                            args, "default_chat_template_kwargs", None),
                        chat_template=getattr(args, "chat_template", None),
                        chat_template_content_format=getattr(
                            args, "chat_template_content_format", "auto"),
                        lora_modules=getattr(args, "lora_modules", None),
                        allowed_local_media_path=getattr(args, "allowed_local_media_path",
                                                         None),
                        responses_store_size=getattr(args, "responses_store_size",
                                                     DEFAULT_STORE_SIZE))


def serve(server: OpenAIServer, config, sockets=None) -> int:
    """Run `server` under uvicorn (config: a uvicorn.Config of server.app) until it stops;
    the exit code is 1 when it stopped because the engine died (a supervisor restarts it)."""
    import uvicorn

    config.timeout_graceful_shutdown = config.timeout_graceful_shutdown or 10
    uv = uvicorn.Server(config)
    server.uvicorn_server = uv
    uv.run(sockets=sockets)
    if server.engine_dead is not None:
        logger.error("exiting: the engine core died (%s)",
                     (str(server.engine_dead).splitlines() or [""])[0])
        return 1
    return 0


def run_server(args) -> int:
    """One API server with its engine core(s) (the launcher does the other layouts)."""
    import uvicorn

    llm = AsyncLLM(engine_config_from_args(args))
    server = make_server(llm, args)
    llm.start()
    return serve(server, uvicorn.Config(server.app, host=args.host, port=args.port,
                                        log_level="info"))
