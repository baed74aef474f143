"""Tool-call parsing and the schemas that force tool calls (no engine needed)."""

from __future__ import annotations

import json

import pytest

from jaxinfer.entrypoints.openai.tools import (HermesToolParser, Llama3JsonToolParser,
                                               ToolError, forced_tool_calls,
                                               messages_for_template, tool_choice_schema,
                                               validate_tools)

TOOLS = validate_tools([
    {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "g"}},
])


def test_hermes_parser():
    p = HermesToolParser()
    content, calls = p.parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
                             '</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}), ("g", {})]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert p.parse("no calls here") == ("no calls here", [])
    bad = 'x <tool_call>{"name": "f", "arguments": {"x": </tool_call>'
    assert p.parse(bad) == (bad, [])  # malformed: the text stays content
    # Streaming holds back from the marker, or from what may become one.
    assert p.safe_prefix("Hello <tool_call>{") == len("Hello ")
    assert p.safe_prefix("Hello <tool_") == len("Hello ")
    assert p.safe_prefix("Hello <b>") == len("Hello <b>")


def test_llama3_json_parser():
    p = Llama3JsonToolParser()
    _, calls = p.parse('<|python_tag|>{"name": "f", "parameters": {"x": 2}}; '
                       '{"name": "g", "parameters": {}}')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 2}), ("g", {})]
    assert p.parse("The answer is 4.") == ("The answer is 4.", [])
    assert p.parse('{"not": "a call"}')[1] == []
    assert p.safe_prefix('{"name"') == 0 and p.safe_prefix("Hi") == 2


def test_forced_schemas_and_calls():
    assert tool_choice_schema("none", TOOLS, None) is None
    assert tool_choice_schema("auto", TOOLS, None) is None
    assert tool_choice_schema({"type": "function", "function": {"name": "f"}}, TOOLS,
                              None) == TOOLS["f"]
    with pytest.raises(ToolError, match="'h', which is not in tools"):
        tool_choice_schema({"type": "function", "function": {"name": "h"}}, TOOLS, None)
    req = tool_choice_schema("required", TOOLS, False)
    assert req["minItems"] == 1 and req["maxItems"] == 1
    assert [v["properties"]["name"]["enum"] for v in req["items"]["anyOf"]] == [["f"], ["g"]]
    calls = forced_tool_calls('[{"name": "f", "parameters": {"x": 3}}]', "required")
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 3}'}
    calls = forced_tool_calls('{"x": 4}', {"type": "function", "function": {"name": "f"}})
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 4}'}
    with pytest.raises(ToolError, match="empty array"):
        validate_tools([])


def test_template_messages_get_argument_objects():
    msgs = messages_for_template([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
