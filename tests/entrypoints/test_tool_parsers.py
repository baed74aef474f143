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


# -- more formats (outputs written from each format's published examples) -----------------------
WEATHER_TOOLS = validate_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"},
                                         "metric": {"type": "boolean"},
                                         "hours": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "get_time"}},
])


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_qwen3_coder_parser():
    from jaxinfer.entrypoints.openai.tools import TOOL_PARSERS

    p = TOOL_PARSERS["qwen3_coder"]()
    text = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
            "</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>"
            "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    content, calls = p.parse(text, WEATHER_TOOLS)
    assert content == "I'll check."
    assert _calls(calls) == [("get_weather", {"city": "New York", "days": 3, "metric": True,
                                              "hours": [9, 12]}), ("get_time", {})]
    # Without the schema, values stay text; a value that does not parse as its type too.
    _, calls = p.parse("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n"
                       "</parameter>\n</function>\n</tool_call>", WEATHER_TOOLS)
    assert _calls(calls) == [("get_weather", {"days": "three"})]
    assert p.parse("No tools needed.") == ("No tools needed.", [])
    assert p.safe_prefix("Sure <tool_") == len("Sure ")
    assert p.safe_prefix("Sure <function=get") == len("Sure ")


def test_pythonic_parser():
    from jaxinfer.entrypoints.openai.tools import TOOL_PARSERS

    p = TOOL_PARSERS["pythonic"]()
    content, calls = p.parse('[get_weather(city="San Francisco", days=2, metric=False), '
                             "get_time()]")
    assert content is None and _calls(calls) == [
        ("get_weather", {"city": "San Francisco", "days": 2, "metric": False}), ("get_time", {})]
    _, calls = p.parse("<|python_start|>[get_time()]<|python_end|>")  # Llama 4
    assert _calls(calls) == [("get_time", {})]
    for text in ("The answer is [1, 2].", "[1, 2]", "[f(x)]", "[__import__('os').system('x')]",
                 "[f(**kw)]", "[f(a=g())]", "[__import__('os').system()]"):
        assert p.parse(text) == (text, []), text  # not calls (literals only): content
    assert p.safe_prefix("[get_weather(") == 0 and p.safe_prefix("Hello") == 5


def test_mistral_parser():
    from jaxinfer.entrypoints.openai.tools import TOOL_PARSERS

    p = TOOL_PARSERS["mistral"]()
    assert p.special_tokens  # [TOOL_CALLS] is a special token: decoded with them
    # Before v11: a JSON array after [TOOL_CALLS].
    content, calls = p.parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                             '"Paris"}}, {"name": "get_time", "arguments": {}}]')
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris"}),
                                                 ("get_time", {})]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    # v11 and later: NAME[ARGS]{...} per call.
    content, calls = p.parse('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                             '[TOOL_CALLS]get_time[ARGS]{}')
    assert content == "Checking." and _calls(calls) == [("get_weather", {"city": "Paris"}),
                                                        ("get_time", {})]
    bad = '[TOOL_CALLS]get_weather[ARGS]{"city": '
    assert p.parse(bad) == (bad, [])
    assert p.safe_prefix("Hi [TOOL_") == 3


def test_deepseek_v3_parser():
    from jaxinfer.entrypoints.openai.tools import TOOL_PARSERS

    p = TOOL_PARSERS["deepseek_v3"]()
    text = ("Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            'get_weather\n```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜>'
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    content, calls = p.parse(text)
    assert content == "Let me look." and _calls(calls) == [("get_weather", {"city": "Tokyo"}),
                                                          ("get_time", {})]
    # V3.1: NAME<｜tool▁sep｜>ARGS.
    _, calls = TOOL_PARSERS["deepseek_v31"]().parse(
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert _calls(calls) == [("get_weather", {"city": "Oslo"})]
    assert p.parse("Plain answer.") == ("Plain answer.", [])
    assert p.safe_prefix("Ok<｜tool▁calls") == 2
