"""`jaxinfer proxy`: one OpenAI endpoint in front of prefill and decode instances.

Each /v1/completions or /v1/chat/completions request goes first to a prefill instance (round
robin) with max_tokens=1, stream=false and kv_transfer_params={"do_remote_decode": true}: it
computes the prompt's KV and keeps it. Its answer's kv_transfer_params go with the original
request to a decode instance (round robin), which pulls the KV and generates; the decode
instance's answer (streamed or not) goes back to the client unchanged. (vLLM's
toy_proxy_server, in a few lines of FastAPI + httpx.)

A prefill instance that cannot be reached or fails is skipped: the decode instance then
computes the prompt itself. Errors in the request (4xx from the prefill instance) go back to
the client as they are. A client that disconnects aborts the decode request.
"""



import itertools
import logging

logger = logging.getLogger("jaxinfer.proxy")

_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                   "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                   "remote_port": None}


def build_app(prefill: list, decode: list, timeout: float = 600.0):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    if not prefill or not decode:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL")
    app = FastAPI(title="jaxinfer P/D proxy")
    next_prefill = itertools.cycle([u.rstrip("/") for u in prefill]).__next__
    next_decode = itertools.cycle([u.rstrip("/") for u in decode]).__next__
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))
    app.state.stats = {"requests": 0, "prefill_failures": 0}

    def _headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def _prefill(path: str, body: dict, headers: dict):
        """(kv_transfer_params or None, an error response to return or None). (No
        `from __future__ import annotations` here: FastAPI reads these local types.)"""
        pbody = dict(body, stream=False, max_tokens=1, kv_transfer_params=dict(_PREFILL_PARAMS))
        pbody.pop("stream_options", None)
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        url = next_prefill() + path
        try:
            r = await client.post(url, json=pbody, headers=headers)
        except httpx.HTTPError as e:
            app.state.stats["prefill_failures"] += 1
            logger.warning("prefill instance %s failed (%s): the decode instance computes the "
                           "prompt", url, e)
            return None, None
        if 400 <= r.status_code < 500:
            return None, Response(r.content, r.status_code, media_type="application/json")
        if r.status_code != 200:
            app.state.stats["prefill_failures"] += 1
            logger.warning("prefill instance %s answered %d: the decode instance computes the "
                           "prompt", url, r.status_code)
            return None, None
        return r.json().get("kv_transfer_params"), None

    async def _forward(path: str, request: Request):
        body = await request.json()
        headers = _headers(request)
        app.state.stats["requests"] += 1
        params, error = await _prefill(path, body, headers)
        if error is not None:
            return error
        dbody = dict(body)
        if params:
            dbody["kv_transfer_params"] = params
        else:
            dbody.pop("kv_transfer_params", None)
        url = next_decode() + path
        if not body.get("stream"):
            r = await client.post(url, json=dbody, headers=headers)
            return Response(r.content, r.status_code, media_type="application/json")
        req = client.build_request("POST", url, json=dbody, headers=headers)
        resp = await client.send(req, stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            return Response(content, resp.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:  # (a client disconnect cancels this: the decode request is aborted)
                await resp.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        r = await client.get(next_decode() + "/v1/models", headers=_headers(request))
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        return JSONResponse({"prefill": prefill, "decode": decode, **app.state.stats})

    @app.on_event("shutdown")
    async def _close():
        await client.aclose()

    return app


def add_parser(sub) -> None:
    p = sub.add_parser("proxy", help="disaggregated prefill/decode: an OpenAI endpoint in "
                       "front of prefill and decode instances")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (jaxinfer serve --kv-transfer-config with kv_role "
                        "kv_producer), e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request to an instance may take")
    p.set_defaults(func=run_proxy)


def run_proxy(args) -> int:
    import uvicorn

    uvicorn.run(build_app(args.prefill, args.decode, args.timeout), host=args.host,
                port=args.port, log_level="info")
    return 0
