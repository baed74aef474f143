"""vLLM's development and RL routes, served only with VLLM_SERVER_DEV_MODE=1 (vLLM's switch;
off, they do not exist: 404): pause / resume, sleep / wake up, collective_rpc, weight
updates from a folder and the weight version. None of them is behind the API key (vLLM's
key guards /v1 only): never expose a dev-mode server.

Answers follow vLLM's (`{"status": "paused"}`, `{"is_sleeping": true}`, ...); bad input is a
400 naming the parameter, in OpenAI's error shape as every other error of this server.
The JSON-body helpers here serve the LoRA routes too (app.py)."""

from __future__ import annotations

import json
import os

from fastapi import Request

from jaxinfer.engine.core import PAUSE_MODES, WAKE_TAGS
from jaxinfer.engine.messages import EngineDeadError
from jaxinfer.entrypoints.openai.errors import APIError


def _jsonable(value):
    """vLLM answers dicts and lists as they are, anything else as its str()."""
    if value is None or isinstance(value, (dict, list)):
        try:
            json.dumps(value)
            return value
        except (TypeError, ValueError):
            pass
    return str(value)


def dev_mode() -> bool:
    return os.environ.get("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true", "yes")


def _query(raw: Request, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    q: dict[str, list[str]] = {}
    for k, v in raw.query_params.multi_items():
        if k not in allowed:
            raise APIError(f"unknown query parameter {k!r} (allowed: "
                           f"{', '.join(allowed) or 'none'})", 400, k)
        q.setdefault(k, []).append(v)
    return q


def _one(q: dict, name: str, default: str) -> str:
    values = q.get(name, [default])
    if len(values) != 1:
        raise APIError(f"{name} given {len(values)} times", 400, name)
    return values[0]


def _bool(q: dict, name: str, default: bool) -> bool:
    value = _one(q, name, str(default)).lower()
    if value not in ("true", "false", "1", "0"):
        raise APIError(f"{name} must be true or false, got {value[:40]!r}", 400, name)
    return value in ("true", "1")


async def json_object(raw: Request) -> dict:
    try:
        body = json.loads(await raw.body() or b"null")
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400, "body") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400, "body")
    return body


def str_field(body: dict, name: str, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise APIError(f"{name} must be a non-empty string of at most 4096 characters", 400,
                       name)
    return value


async def _engine_call(server, name: str, *args):
    """A utility of the engine; its ValueError is the client's 400."""
    err = server.llm.dead_error
    if err is not None:
        raise EngineDeadError(str(err))
    try:
        return await getattr(server.llm, name)(*args)
    except ValueError as e:
        raise APIError(str(e), 400) from None


def add_dev_routes(app, server) -> None:
    @app.post("/pause")
    async def pause(raw: Request):
        q = _query(raw, ("mode", "clear_cache"))
        mode = _one(q, "mode", "abort")
        if mode not in PAUSE_MODES:
            raise APIError(f"mode must be one of {', '.join(PAUSE_MODES)}, got "
                           f"{mode[:40]!r}", 400, "mode")
        clear = _bool(q, "clear_cache", True)
        err = server.llm.dead_error
        if err is not None:
            raise EngineDeadError(str(err))
        try:
            await server.llm.pause_generation(mode=mode, clear_cache=clear)
        except ValueError as e:
            raise APIError(str(e), 400) from None
        return {"status": "paused"}

    @app.post("/resume")
    async def resume(raw: Request):
        _query(raw, ())
        await _engine_call(server, "resume_generation")
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused(raw: Request):
        _query(raw, ())
        return {"is_paused": bool(await _engine_call(server, "is_paused"))}

    @app.post("/sleep")
    async def sleep(raw: Request):
        q = _query(raw, ("level", "mode"))
        level = _one(q, "level", "1")
        if level not in ("0", "1", "2"):
            raise APIError(f"level must be 0, 1 or 2, got {level[:40]!r}", 400, "level")
        mode = _one(q, "mode", "abort")
        if mode not in PAUSE_MODES:
            raise APIError(f"mode must be one of {', '.join(PAUSE_MODES)}, got "
                           f"{mode[:40]!r}", 400, "mode")
        await _engine_call(server, "sleep", int(level), mode)
        return {"status": "sleeping", "level": int(level)}

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        q = _query(raw, ("tags",))
        tags = q.get("tags") or None
        for t in tags or ():
            if t not in WAKE_TAGS:
                raise APIError(f"tags: {t[:40]!r} is not one of {', '.join(WAKE_TAGS)}", 400,
                               "tags")
        awake = await _engine_call(server, "wake_up", tags)
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping(raw: Request):
        _query(raw, ())
        return {"is_sleeping": bool(await _engine_call(server, "is_sleeping"))}

    @app.post("/collective_rpc")
    async def collective_rpc(raw: Request):
        """vLLM's: a worker method by name with string arguments only."""
        _query(raw, ())
        body = await json_object(raw)
        extra = sorted(set(body) - {"method", "args", "kwargs", "timeout"})
        if extra:
            raise APIError(f"unknown field(s) {extra}", 400, extra[0])
        method = str_field(body, "method")
        args = body.get("args") or []
        kwargs = body.get("kwargs") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise APIError("args must be a list of strings", 400, "args")
        if not isinstance(kwargs, dict) or not all(isinstance(v, str) for v in kwargs.values()):
            raise APIError("kwargs must be an object of strings", 400, "kwargs")
        if body.get("timeout") is not None:
            raise APIError("timeout is not supported (the call runs between two engine "
                           "steps)", 400, "timeout")
        results = await _engine_call(server, "collective_rpc", method, tuple(args), kwargs)
        return {"results": [_jsonable(r) for r in results]}

    @app.post("/update_weights_from_path")
    async def update_weights_from_path(raw: Request):
        """jaxinfer's: new weights from a safetensors folder on the server's machine, all
        or nothing; the prefix cache is reset."""
        _query(raw, ())
        body = await json_object(raw)
        extra = sorted(set(body) - {"path", "weight_version"})
        if extra:
            raise APIError(f"unknown field(s) {extra}", 400, extra[0])
        path = str_field(body, "path")
        version = str_field(body, "weight_version", required=False)
        result = await _engine_call(server, "update_weights_from_path", path, version)
        return {"message": "Weights updated", **result}

    @app.post("/update_weights_from_transfer")
    async def update_weights_from_transfer(raw: Request):
        """jaxinfer's: {"payload": WeightSender.offer's answer, "weight_version"}."""
        _query(raw, ())
        body = await json_object(raw)
        extra = sorted(set(body) - {"payload", "weight_version"})
        if extra:
            raise APIError(f"unknown field(s) {extra}", 400, extra[0])
        if not isinstance(body.get("payload"), dict):
            raise APIError("payload must be an object (WeightSender.offer's answer)", 400,
                           "payload")
        version = str_field(body, "weight_version", required=False)
        result = await _engine_call(server, "update_weights_from_transfer", body["payload"],
                                    version)
        return {"message": "Weights updated", **result}

    @app.get("/weight_info")
    async def weight_info(raw: Request):
        _query(raw, ())
        return {"weight_version": await _engine_call(server, "get_weight_version")}

    @app.post("/update_weight_version")
    async def update_weight_version(raw: Request):
        _query(raw, ())
        body = await json_object(raw)
        extra = sorted(set(body) - {"new_version"})
        if extra:
            raise APIError(f"unknown field(s) {extra}", 400, extra[0])
        version = str_field(body, "new_version")
        await _engine_call(server, "set_weight_version", version)
        return {"success": True, "new_version": version}
