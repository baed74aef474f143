"""Errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}): the exception the
routes raise, its JSON response, and the mapping of pydantic errors, a dead engine and
unexpected failures onto it."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from jaxinfer.entrypoints.openai.protocol import UnsupportedField
from jaxinfer.outputs import RequestOutput


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.headers = headers
        self.err_type = err_type or {
            400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            405: "MethodNotAllowedError", 413: "RequestTooLargeError",
            422: "UnprocessableEntityError", 429: "RateLimitError", 499: "ClientDisconnected",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")


def engine_dead(err: BaseException) -> APIError:
    first = (str(err).splitlines() or [""])[0]
    return APIError(f"the engine is dead and cannot serve requests ({first}); the server is "
                    "shutting down", 503, None, "EngineDeadError")


def internal_error(err: BaseException) -> APIError:
    return APIError(f"internal server error ({type(err).__name__}); see the server log", 500,
                    None, "InternalServerError")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(status_code=e.status, headers=e.headers, content={"error": {
        "message": e.message, "type": e.err_type, "param": e.param, "code": e.status}})


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's first error as a 400 naming the field (UnsupportedField: its own message)."""
    err = errors[0] if errors else {}
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedField):  # a field we cannot honour: say which
        return APIError(str(cause), 400, cause.field)
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # (pydantic names union members in loc: "stop.str", "stop.list[...]"; keep the field path)
    loc = [x for x in loc if not (x[:1].isalpha() and ("[" in x or x in _TYPE_NAMES))]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":
        msg = f"malformed JSON body: {msg}"
    ctx = err.get("ctx") or {}
    if "le" in ctx or "ge" in ctx or "lt" in ctx or "gt" in ctx or "max_length" in ctx:
        got = repr(err.get("input"))
        msg = f"{msg}, got {got[:60]}"
    return APIError(f"{param}: {msg}" if param else msg, 400, param)


def validated(model, obj: dict):
    """`obj` as pydantic `model`, or a 400 naming the field: the deepest of pydantic's errors
    (of a union, the member that got furthest); an unknown field is named as such."""
    from pydantic import ValidationError

    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = sorted(e.errors(), key=lambda x: -len(x.get("loc", ())))
    err = errors[0] if errors else {}
    if err.get("type") == "extra_forbidden":
        field = ".".join(str(x) for x in err.get("loc", ()) if not str(x)[:1].isupper())
        raise APIError(f"{field}: unsupported request field", 400, field)
    raise validation_error(errors)


_TYPE_NAMES = ("str", "int", "float", "bool", "list", "dict", "none", "constrained-str",
               "constrained-int", "function-after", "function-before", "function-wrap")


def check_kv_transfer(outs: list[RequestOutput]) -> None:
    """A KV transfer that failed under kv_load_failure_policy "fail" is a 503, not an empty
    completion."""
    for o in outs:
        for c in o.outputs:
            if (c.finish_reason == "abort" and isinstance(c.stop_reason, str)
                    and c.stop_reason.startswith("KV ")):
                raise APIError(c.stop_reason, 503, "kv_transfer_params")


def raise_if_failed(out: RequestOutput) -> None:
    """A request the engine failed (finish_reason "error": it alone; the engine serves on)."""
    for c in out.outputs:
        if c.finish_reason == "error":
            raise APIError(f"the engine failed this request: {c.stop_reason}", 500, None,
                           "InternalServerError")
