"""Reasoning parsers (jaxinfer/reasoning.py): the split of recorded outputs of each format, and
the property streaming relies on: the split of any prefix of an output (not finished) is a
prefix of the split of the whole, part by part, so what was streamed is never taken back."""

from __future__ import annotations

import pytest

from jaxinfer.reasoning import REASONING_PARSERS, get_reasoning_parser

# (parser, output, thinking at the start, finished split (reasoning, content))
CASES = [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", True,
     ("\nThe user greets me.\n", "\n\nHello! How can I help?")),
    # Qwen3.5 / thinking templates open the section in the prompt: only the end tag comes.
    ("qwen3", "Greeting: answer briefly.</think>Hi!", True, ("Greeting: answer briefly.", "Hi!")),
    # enable_thinking false: the template closes the section in the prompt.
    ("qwen3", "Hi! No thinking here.", False, (None, "Hi! No thinking here.")),
    # cut short (length) while thinking: all of it is reasoning
    ("qwen3", "<think>Let me count: 1, 2, 3", True, ("Let me count: 1, 2, 3", None)),
    # thinking that ends in the tag: no content
    ("qwen3", "<think>Nothing to add.</think>", True, ("Nothing to add.", None)),
    # Qwen3.5 may start a Qwen3-Coder style call without closing the thinking
    ("qwen3", "I need the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Oslo\n</parameter>\n</function>\n</tool_call>", True,
     ("I need the weather.\n", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
                               "</parameter>\n</function>\n</tool_call>")),
    # ... but a <tool_call> mentioned in the thinking is not one
    ("qwen3", "<think>Should I emit <tool_call> here? No.</think>Sure.", True,
     ("Should I emit <tool_call> here? No.", "Sure.")),
    # DeepSeek-R1: thinking first, with or without the start tag
    ("deepseek_r1", "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", True,
     ("Okay, 2 + 2 is 4.\n", "\n\nThe answer is 4.")),
    ("deepseek_r1", "<think>\nOkay.\n</think>\n\n4", True, ("\nOkay.\n", "\n\n4")),
    ("deepseek_v3", "4", False, (None, "4")),
    ("deepseek_v3", "Simple sum.</think>4", True, ("Simple sum.", "4")),
    # gpt-oss (harmony, decoded with its special tokens; <|return|> is a stop token)
    ("openai_gptoss", "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Hello! How can I help?", True,
     ("User says hi.", "Hello! How can I help?")),
    ("openai_gptoss", "<|channel|>analysis<|message|>2 + 2.<|end|><|start|>assistant<|channel|>"
     "analysis<|message|>It is 4.<|end|><|start|>assistant<|channel|>final<|message|>4", True,
     ("2 + 2.\nIt is 4.", "4")),
    ("openai_gptoss", "<|channel|>analysis<|message|>Counting: 1, 2", True,
     ("Counting: 1, 2", None)),
    # a tool call after the thinking: the answer is the call's message, whole (the `openai`
    # tool parser reads it), in either place harmony allows the recipient
    ("openai_gptoss", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Oslo"}', True,
     ("Need the weather.", "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                           '<|constrain|>json<|message|>{"city": "Oslo"}')),
    ("openai_gptoss", "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant "
     'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}', True,
     ("Weather.", '<|start|>assistant to=functions.get_weather<|channel|>commentary json'
                  '<|message|>{"city": "Oslo"}')),
    # a preamble (commentary without a recipient) is reasoning too
    ("openai_gptoss", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Done.", True, ("Checking.", "Done.")),
    # a prompt that opened the final channel; a model that ignored the format
    ("openai_gptoss", "Hi there", False, (None, "Hi there")),
    ("openai_gptoss", "Hi <|end|> there", True, (None, "Hi <|end|> there")),
]
TAGS = {"openai_gptoss": ("<|", "|>", "analysis", "final")}


@pytest.mark.parametrize("name,text,thinking,expected", CASES)
def test_split_of_recorded_outputs(name, text, thinking, expected):
    assert tuple(get_reasoning_parser(name).split(text, thinking, True)) == expected


@pytest.mark.parametrize("name,text,thinking,expected", CASES)
def test_every_prefix_splits_into_prefixes_of_the_whole(name, text, thinking, expected):
    parser = get_reasoning_parser(name)
    reasoning, content = expected
    sent_r = sent_c = 0
    for k in range(len(text) + 1):
        r, c = parser.split(text[:k], thinking, False)
        r, c = r or "", c or ""
        assert (reasoning or "").startswith(r), (k, r)
        assert (content or "").startswith(c), (k, c)
        assert len(r) >= sent_r and len(c) >= sent_c  # never taken back
        sent_r, sent_c = len(r), len(c)
        # a tag, or a piece of one, is never streamed as text
        if not thinking or (reasoning is None and content == text):
            continue  # (all answer: the text as it is)
        if "to=" in text:  # (a harmony tool call: its message is the answer, markers and all)
            assert "<|" not in r
            continue
        for tag in TAGS.get(name, ("<think>", "</think>", "</thi", "<thi")):
            assert tag not in r and tag not in (c if "<tool_call>" not in text else "")


def test_where_the_output_starts_from_the_prompt():
    q = get_reasoning_parser("qwen3")
    assert q.starts_thinking("<|im_start|>assistant\n")  # the model opens it (or not)
    assert q.starts_thinking("<|im_start|>assistant\n<think>\n")  # the template opened it
    assert not q.starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not q.starts_thinking("<|im_start|>assistant\n", {"enable_thinking": False})
    assert q.starts_thinking("<|im_start|>assistant\n", {"enable_thinking": True})
    v3 = get_reasoning_parser("deepseek_v3")
    assert not v3.starts_thinking("<｜Assistant｜></think>")
    assert not v3.starts_thinking("<｜Assistant｜><think>", {})  # thinking not asked for
    assert v3.starts_thinking("<｜Assistant｜><think>", {"thinking": True})
    assert v3.starts_thinking("<｜Assistant｜><think>")  # (variables unknown: the prompt says)
    harmony = get_reasoning_parser("openai_gptoss")
    assert harmony.starts_thinking("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert not harmony.starts_thinking("<|start|>assistant<|channel|>final<|message|>")
    r1 = get_reasoning_parser("deepseek_r1")
    assert r1.starts_thinking("<｜Assistant｜>") and r1.starts_thinking("<｜Assistant｜><think>\n")


def test_unknown_parser_is_refused_by_name():
    from jaxinfer.config import EngineConfig

    with pytest.raises(ValueError, match="reasoning_parser='qwen4'.*qwen3"):
        EngineConfig(reasoning_parser="qwen4")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "deepseek_v3", "openai_gptoss"}
