"""Tool calling for the chat endpoint (vLLM's behaviour).

- `tool_choice` "required" or a named function: the output is constrained with structured
  outputs (a JSON schema built from the tools), so it always parses into tool calls.
  Named: the output is the function's arguments. Required: a JSON array of
  {"name", "parameters"} objects (at most one when parallel_tool_calls is false).
- `tool_choice` "auto" (the default when tools are given): the model decides; a tool-call parser
  chosen at start-up (`--enable-auto-tool-choice --tool-call-parser hermes|llama3_json`) finds
  the calls in the text. Without those flags "auto" with tools is refused, as in vLLM.
- finish_reason is "tool_calls" when auto or required produced calls, "stop" for a named one.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any


class ToolError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def validate_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict]:
    """name -> parameters schema; ToolError naming what is wrong."""
    if tools is None:
        return {}
    if not tools:
        raise ToolError("tools", "tools must not be an empty array: provide at least one tool "
                                 "or omit the field")
    out = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"tools[{i}].type", f"tools[{i}]: only function tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}].function.name", f"tools[{i}].function.name is required")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters",
                            f"tools[{i}].function.parameters must be a JSON schema object")
        out[fn["name"]] = params if params else {"type": "object", "properties": {}}
    return out


def named_tool(tool_choice) -> str | None:
    """The function name of a named tool_choice ({"type": "function", "function": {...}})."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ToolError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        return fn["name"]
    return None


def tool_choice_schema(tool_choice, tools: dict[str, dict], parallel_tool_calls: bool | None
                       ) -> dict | None:
    """The JSON schema that forces the tool call(s), or None (none / auto)."""
    name = named_tool(tool_choice)
    if name is not None:
        if name not in tools:
            raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not "
                                           "in tools")
        return tools[name]
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for fname, params in tools.items():
        params = dict(params)
        for k, v in (params.pop("$defs", None) or {}).items():
            if k in defs and defs[k] != v:
                raise ToolError("tools", f"tools define $defs {k!r} twice, differently")
            defs[k] = v
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [fname]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_tool_calls(text: str, tool_choice) -> list[dict]:
    """The calls of a named / required output (it parses: the grammar made it)."""
    name = named_tool(tool_choice)
    if name is not None:
        return [_call(name, text.strip())]
    return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in json.loads(text)]


def _call(name: str, arguments: str) -> dict:
    return {"id": make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


# -- parsers for tool_choice="auto" --------------------------------------------------------------
class ToolParser:
    """Finds tool calls in a model's text. `start` is the marker of a call: streaming holds the
    text back from where it (or a prefix of it) appears."""

    start = ""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls)."""
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How much of a partial output is surely content (streamable as is)."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen2.5/3 templates)."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text):
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                obj = json.loads(body.strip())
                calls.append(_call(obj["name"], json.dumps(
                    obj.get("arguments", obj.get("parameters", {})), ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):
                return text, []  # not a well-formed call: the text is content
        content = text[: text.find(self.start)].rstrip()  # a prefix of the text, as streamed
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    """{"name": ..., "parameters": {...}} (Llama 3.x JSON tool calls), optionally after
    <|python_tag|>, several separated by ';'."""

    start = "{"

    def parse(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        dec = json.JSONDecoder()
        calls, i = [], 0
        try:
            while i < len(body):
                obj, i = dec.raw_decode(body, i)
                calls.append(_call(obj["name"], json.dumps(
                    obj.get("parameters", obj.get("arguments", {})), ensure_ascii=False)))
                while i < len(body) and body[i] in " \n\t;":
                    i += 1
        except (ValueError, KeyError, TypeError):
            return text, []
        return None, calls

    def safe_prefix(self, text):
        return 0 if text.lstrip().removeprefix("<|python_tag|>").lstrip()[:1] in ("{", "") \
            else len(text)


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def messages_for_template(messages: list[dict]) -> list[dict]:
    """Tool-call arguments as objects (templates index into them), as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out
