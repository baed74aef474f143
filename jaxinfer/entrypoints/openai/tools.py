"""Tool calling for the chat endpoint (vLLM's behaviour).

- `tool_choice` "required" or a named function: the output is constrained with structured
  outputs (a JSON schema built from the tools), so it always parses into tool calls.
  Named: the output is the function's arguments. Required: a JSON array of
  {"name", "parameters"} objects (at most one when parallel_tool_calls is false).
- `tool_choice` "auto" (the default when tools are given): the model decides; a tool-call parser
  chosen at start-up (`--enable-auto-tool-choice --tool-call-parser NAME`: hermes,
  llama3_json, qwen3_coder / qwen3_xml, pythonic, mistral, deepseek_v3 / deepseek_v31,
  openai (gpt-oss's harmony)) finds
  the calls in the text; streamed, the text from a call's marker on is held back and the calls
  go out when the choice ends. Without those flags "auto" with tools is refused, as in vLLM.
- finish_reason is "tool_calls" when auto or required produced calls, "stop" for a named one.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from jaxinfer.reasoning import before_marker


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


def _call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


# -- parsers for tool_choice="auto" --------------------------------------------------------------
class ToolParser:
    """Finds tool calls in a model's text. `start` is the marker of a call: streaming holds the
    text back from where it (or a prefix of it) appears, and sends the calls when the choice
    ends. `special_tokens`: the markers are special tokens, so the text is decoded with them
    (skip_special_tokens=False, as vLLM's parsers of such formats ask)."""

    start = ""
    special_tokens = False

    def parse(self, text: str, tools: dict[str, dict] | None = None
              ) -> tuple[str | None, list[dict]]:
        """(content, calls); tools: name -> parameters schema, for formats whose arguments
        come as text and are typed by the schema."""
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How much of a partial output is surely content (streamable as is)."""
        return before_marker(text, self.start)


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen2.5/3 templates)."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text, tools=None):
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

    def parse(self, text, tools=None):
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


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder / Qwen3.5 XML calls:
    <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...</function>\n
    </tool_call>. Values are text, typed by the tool's schema (integer, number, boolean,
    object, array, null: parsed as JSON / Python literals; else the string)."""

    start = "<tool_call>"
    _function = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)",
                            re.S)

    def parse(self, text, tools=None):
        i = text.find(self.start)
        j = text.find("<function=")
        if j < 0:
            return text, []
        cut = i if 0 <= i <= j else j
        calls = []
        for name, body in self._function.findall(text[cut:]):
            name = name.strip()
            props = ((tools or {}).get(name) or {}).get("properties") or {}
            args = {}
            for key, value in self._parameter.findall(body):
                key = key.strip()
                args[key] = _typed(value, (props.get(key) or {}).get("type"))
            calls.append(_call(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:cut].rstrip() or None, calls

    def safe_prefix(self, text):
        return min(super().safe_prefix(text), before_marker(text, "<function="))


class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 pythonic calls: [get_weather(city="Oslo"), get_time()] (a Python
    list of calls with literal keyword arguments; Llama 4 may wrap it in <|python_start|>
    ... <|python_end|>)."""

    start = "["

    def parse(self, text, tools=None):
        import ast

        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        body = body.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or node.args or not re.fullmatch(
                        r"[A-Za-z_][\w.]*", ast.unparse(node.func)):
                    return text, []
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                if None in args:  # (**kwargs)
                    return text, []
                calls.append(_call(ast.unparse(node.func),
                                   json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return None, calls

    def safe_prefix(self, text):
        lead = text.lstrip().removeprefix("<|python_start|>").lstrip()
        return 0 if lead[:1] in ("[", "") or "<|python_start|>".startswith(text.lstrip()) \
            else len(text)


class MistralToolParser(ToolParser):
    """Mistral: [TOOL_CALLS] then either a JSON array of {"name", "arguments"} (tokenizers
    before v11) or NAME[ARGS]{...} per call (v11 and later). Call ids are 9 alphanumerics, as
    Mistral's templates require."""

    start = "[TOOL_CALLS]"
    special_tokens = True

    def parse(self, text, tools=None):
        i = text.find(self.start)
        if i < 0:
            return text, []
        rest = text[i:]
        calls = []
        try:
            for part in rest.split(self.start)[1:]:
                part = part.strip()
                if not part:
                    continue
                if part.startswith("["):
                    for obj in json.loads(part):
                        calls.append(_call(obj["name"], json.dumps(
                            obj.get("arguments", {}), ensure_ascii=False), _mistral_id()))
                    continue
                name, sep, args = part.partition("[ARGS]")
                if not sep:
                    return text, []
                obj = json.JSONDecoder().raw_decode(args.strip())[0]
                calls.append(_call(name.strip(), json.dumps(obj, ensure_ascii=False),
                                   _mistral_id()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        if not calls:
            return text, []
        return text[:i].rstrip() or None, calls


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3 / R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>; V3.1's NAME<｜tool▁sep｜>ARGS
    without the type and the fence is read too."""

    start = "<｜tool▁calls▁begin｜>"
    special_tokens = True
    _one = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
    _fenced = re.compile(r"\s*(\S+?)\s*\n```(?:json)?\s*\n(.*?)\n```\s*$", re.S)

    def parse(self, text, tools=None):
        i = text.find(self.start)
        if i < 0:
            return text, []
        calls = []
        try:
            for head, body in self._one.findall(text[i:]):
                fenced = self._fenced.match(body) if head.strip() == "function" else None
                name, args = (fenced.group(1), fenced.group(2)) if fenced else (head, body)
                obj = json.loads(args.strip())
                calls.append(_call(name.strip(), json.dumps(obj, ensure_ascii=False)))
        except (ValueError, TypeError):
            return text, []
        if not calls:
            return text, []
        return text[:i].rstrip() or None, calls


class HarmonyToolParser(ToolParser):
    """gpt-oss (harmony; vLLM's `openai`): a call is a message whose header names its
    recipient, `to=functions.NAME` (in the channel part, `<|channel|>commentary
    to=functions.NAME <|constrain|>json`, or the role part, `<|start|>assistant
    to=functions.NAME<|channel|>commentary`), its body the arguments (as written), ended by
    `<|call|>`. The content is the final messages' bodies. With `--reasoning-parser
    openai_gptoss` the text here starts at the first call's header."""

    start = "<|"
    special_tokens = True
    _message = re.compile(r"(?:^|<\|start\|>)((?:(?!<\|message\|>).)*?)<\|message\|>(.*?)"
                          r"(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)", re.S)
    _recipient = re.compile(r"to=functions\.([^\s<]+)")

    def parse(self, text, tools=None):
        if "to=" not in text:
            return text, []
        calls, content = [], []
        for header, body in self._message.findall(text):
            to = self._recipient.search(header)
            if to:
                calls.append(_call(to.group(1), body.strip()))
            elif "<|channel|>final" in header:
                content.append(body)
        if not calls:
            return text, []
        return "".join(content) or None, calls


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                "qwen3_coder": Qwen3CoderToolParser, "qwen3_xml": Qwen3CoderToolParser,
                "pythonic": PythonicToolParser, "mistral": MistralToolParser,
                "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV3ToolParser,
                "openai": HarmonyToolParser}


def _typed(value: str, kind) -> Any:
    """A parameter's text as its schema's type says (vLLM's Qwen3-Coder rule: what does not
    parse stays the string)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if value.strip() == "null" and "null" in kinds:
        return None
    if any(k in ("integer", "number", "boolean", "object", "array") for k in kinds):
        import ast

        for load in (json.loads, ast.literal_eval):
            try:
                return load(value.strip())
            except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
                continue
    return value


def _mistral_id() -> str:
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


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
