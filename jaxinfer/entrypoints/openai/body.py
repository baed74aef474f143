"""Request bodies, read and checked before pydantic sees them.

Everything here is bounded and cheap, and runs before any work that grows with the body:
- JSON is parsed strictly: valid UTF-8, no NaN / Infinity tokens, at most MAX_JSON_DEPTH levels
  of nesting (deeper JSON would exhaust recursion in the parser or in code that walks it), and
  no lone UTF-16 surrogates in any string (they cannot be tokenized or encoded back);
- the prompt of /v1/completions is checked with fast loops (shape, count, length, token-id
  range) and reaches pydantic only once it is known to be sound (pydantic's union validation
  of a million-token prompt holds the event loop for a second);
- list fields that the engine walks per token get their length limits before validation.
Each failure is a BodyError: the server answers 400 in OpenAI's shape naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from jaxinfer.validation import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOOLS

MAX_JSON_DEPTH = 128  # nesting levels of a request body (llguidance's JSON parser allows 128)

# A \uD800-\uDFFF escape: the only way a surrogate reaches a decoded string (raw UTF-8 cannot
# encode one); pairs decode into one character, so any surrogate left is a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))  # (bytes.translate deletes)

# field -> the most items it may hold (checked before validation; SamplingParams checks again)
LIST_LIMITS = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS,
               "tools": MAX_TOOLS}


class BodyError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _no_constant(name: str):
    raise BodyError(f"malformed JSON body: {name} is not a JSON value (numbers must be finite)",
                    None)


def json_depth(raw: bytes) -> int:
    """How deeply the JSON text nests (strings skipped): a few C-speed passes."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= 2 * MAX_JSON_DEPTH:
        # (can it exceed the limit at all?) quick path for ordinary bodies
        depth = best = 0
        for c in brackets:
            depth += 1 if c in (0x5B, 0x7B) else -1
            best = max(best, depth)
        return best
    steps = np.frombuffer(brackets, np.uint8)
    steps = np.where((steps == 0x5B) | (steps == 0x7B), 1, -1)
    return int(np.cumsum(steps).max())


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a dict, or BodyError."""
    if not raw.strip():
        raise BodyError("the request body is empty: a JSON object is expected")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the request body is not valid UTF-8 (byte {e.start})") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise BodyError(f"the request body nests {depth} levels deep, more than the limit of "
                        f"{MAX_JSON_DEPTH}")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(f"the request body nests more than {MAX_JSON_DEPTH} levels deep") \
            from None
    except ValueError as e:
        raise BodyError(f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise BodyError(f"the request body must be a JSON object, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        path = _lone_surrogate_path(obj)
        if path is not None:
            raise BodyError(f"{path or 'body'}: contains a lone UTF-16 surrogate "
                            "(\\ud800-\\udfff not part of a pair): not valid Unicode",
                            path or None)
    return obj


def _bad_string(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _lone_surrogate_path(obj: Any) -> str | None:
    """The path of the first key or string holding a lone surrogate (iterative walk)."""
    stack = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _bad_string(node):
                return path
        elif isinstance(node, dict):
            for k, v in node.items():
                sub = f"{path}.{k}" if path else str(k)
                if _bad_string(k):  # a key: name the object that holds it
                    return path
                stack.append((v, sub))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def check_list_limits(obj: dict[str, Any]) -> None:
    for name, limit in LIST_LIMITS.items():
        value = obj.get(name)
        if isinstance(value, list) and len(value) > limit:
            raise BodyError(f"{name} has {len(value)} items, more than the limit of {limit}",
                            name)


def _token_list(ids: list, field: str, vocab_size: int, max_model_len: int | None) -> None:
    if max_model_len is not None and len(ids) > max_model_len:
        raise BodyError(f"The prompt has {len(ids)} tokens, longer than the model's maximum "
                        f"context length of {max_model_len} tokens.", field)
    if not ids:
        raise BodyError(f"{field}: a token-id prompt must not be empty", field)
    if not all(type(t) is int for t in ids):
        bad = next(t for t in ids if type(t) is not int)
        raise BodyError(f"{field}: token ids must be integers, got {json.dumps(bad)[:40]}", field)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise BodyError(f"{field}: token id {bad} is out of vocabulary [0, {vocab_size})", field)


def check_prompt(obj: dict[str, Any], *, max_prompts: int, vocab_size: int,
                 max_model_len: int | None, field: str = "prompt") -> None:
    """The completions prompt: a string, a list of strings, token ids, or lists of token ids,
    at most `max_prompts` of them, each list of ids within the context and the vocabulary."""
    if field not in obj:
        raise BodyError(f"{field}: field required", field)
    if isinstance(obj.get("truncate_prompt_tokens"), int):
        max_model_len = None  # (longer prompts are cut to their last tokens, then checked)
    prompt = obj[field]
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise BodyError(f"{field} must be a string, a list of strings, a list of token ids or a "
                        f"list of lists of token ids, got {type(prompt).__name__}", field)
    if not prompt:
        raise BodyError(f"{field} must not be empty", field)
    first = prompt[0]
    if type(first) is int:
        _token_list(prompt, field, vocab_size, max_model_len)
        return
    if len(prompt) > max_prompts:
        raise BodyError(f"{field} has {len(prompt)} prompts, more than the limit of "
                        f"{max_prompts} per request (--max-prompts-per-request)", field)
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise BodyError(f"{field}: a list of prompts must be all strings or all lists of "
                            "token ids", field)
        return
    if isinstance(first, list):
        for i, p in enumerate(prompt):
            if not isinstance(p, list):
                raise BodyError(f"{field}: a list of prompts must be all strings or all lists "
                                "of token ids", field)
            _token_list(p, f"{field}[{i}]", vocab_size, max_model_len)
        return
    raise BodyError(f"{field} must be a string, a list of strings, a list of token ids or a list "
                    f"of lists of token ids; {field}[0] is {type(first).__name__}", field)
