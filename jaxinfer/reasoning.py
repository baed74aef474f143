"""Reasoning models' thinking sections (vLLM's `--reasoning-parser`).

A reasoning model writes its thinking between two tags (`<think>` ... `</think>` for Qwen3 and
DeepSeek-R1) before its answer. With a parser named at start-up:
- the chat route splits each choice's text into `reasoning_content` (also sent as `reasoning`,
  vLLM's newer name) and `content`, in full responses and in streamed deltas, holding back a
  tag split across chunks; tool calls are looked for in the content only;
- structured outputs (response_format, forced tool calls) constrain only the answer: the engine
  core leaves a request's grammar off until its output ends with the end tag
  (`EngineCoreRequest.reasoning_end_ids`, set by the Processor).

Where the output starts is read from the prompt: a chat template that opens the thinking
section itself (Qwen3.5, DeepSeek-R1's newer templates, DeepSeek-V3.1 with thinking on) ends
the prompt after the start tag; one that turns thinking off (Qwen3 with
`enable_thinking: false`, DeepSeek-V3.1 without `thinking`) closes it in the prompt, so the
output is all answer. With neither tag at the end of the prompt the parser's default applies
(in thinking for qwen3 and deepseek_r1: the model writes the start tag itself, or nothing, and
an output that never closes the section was cut short, all of it reasoning).
"""

from __future__ import annotations

import re
from typing import NamedTuple

# How much of the prompt's end is read to find the last tag (tokens).
PROMPT_TAIL_TOKENS = 64


class Split(NamedTuple):
    reasoning: str | None  # the thinking text so far (None: the choice has none)
    content: str | None  # the answer so far (None: still thinking)


class ReasoningParser:
    """Text-level split of one choice's output (stateless: the caller passes the whole text so
    far, so a tag split across stream chunks is found once it is whole)."""

    name = ""
    start = "<think>"
    end = "</think>"
    thinks_by_default = True  # no tag at the prompt's end: the output starts in thinking
    thinking_kwarg: str | None = None  # a chat-template switch that turns thinking off
    # The tags are special tokens: the route decodes the output with them (not skipped).
    needs_special_tokens = False

    def starts_thinking(self, prompt_tail: str, template_kwargs: dict | None = None) -> bool:
        """Whether the output starts inside the thinking section, from the end of the rendered
        prompt (text) and the request's chat-template variables."""
        kwargs = template_kwargs or {}
        if self.thinking_kwarg is not None and self.thinking_kwarg in kwargs \
                and not kwargs[self.thinking_kwarg]:
            return False
        s, e = prompt_tail.rfind(self.start), prompt_tail.rfind(self.end)
        if s < 0 and e < 0:
            return self.thinks_by_default
        return s > e

    def _implicit_end(self, body: str, finished: bool) -> tuple[int, bool] | None:
        """Where the thinking stops without the end tag, if the model's format has such a case:
        (i, True) the answer starts at i; (i, False) it may (not finished: hold back from i)."""
        return None

    def split(self, text: str, thinking: bool, finished: bool) -> Split:
        """`text`: the choice's output so far; `thinking`: it started in the thinking section.
        While not finished, the end of the thinking text that could be the start of a tag is
        held back (left out of `reasoning`)."""
        if not thinking:
            return Split(None, text)
        lead = text.lstrip()
        body = lead[len(self.start):] if lead.startswith(self.start) else text
        if not finished and body is text and lead and self.start.startswith(lead):
            return Split("", None)  # the start tag may be coming
        i = body.find(self.end)
        if i >= 0:
            answer = body[i + len(self.end):]
            return Split(body[:i], answer or None if finished else answer)
        implicit = self._implicit_end(body, finished)
        if implicit is not None:
            i, sure = implicit
            if sure:
                return Split(body[:i], body[i:] or None if finished else body[i:])
            return Split(body[:i], None)
        if finished:
            return Split(body, None)
        return Split(body[:before_marker(body, self.end)], None)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 / Qwen3.5 / QwQ: `<think>` ... `</think>`; `enable_thinking: false` turns it off.
    A `<tool_call>` followed by `<function=` (Qwen3-Coder's call format) also ends the thinking
    when the model skips `</think>` (as Qwen3.5 may)."""

    name = "qwen3"
    thinking_kwarg = "enable_thinking"
    _call = "<tool_call>"
    _function = re.compile(r"\s*<function[\s=]")

    def _implicit_end(self, body, finished):
        k = body.find(self._call)
        while k >= 0:
            rest = body[k + len(self._call):]
            if self._function.match(rest):
                return k, True
            if not finished and "<function".startswith(rest.lstrip()[:9]):
                return k, False  # "<function" may be coming
            k = body.find(self._call, k + 1)
        if not finished and _partial_suffix(body, self._call):
            return len(body) - _partial_suffix(body, self._call), False
        return None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): thinking first, whether or not the model writes `<think>`;
    `</think>` ends it."""

    name = "deepseek_r1"


class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1 / V3.2: thinking only when the request's chat-template variables say
    `thinking: true` (the template then opens the section in the prompt)."""

    name = "deepseek_v3"
    thinks_by_default = False

    def starts_thinking(self, prompt_tail, template_kwargs=None):
        if template_kwargs is not None and not template_kwargs.get("thinking"):
            return False  # (None: the variables are not known; the prompt tells)
        return super().starts_thinking(prompt_tail, template_kwargs)


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony format (vLLM's `openai_gptoss`): the output is a run of messages,
    each a header (`<|channel|>NAME`, a recipient `to=functions.NAME` in a tool call's, and
    `<|start|>assistant` before every message but the first) then `<|message|>BODY`, ended by
    `<|end|>`, `<|call|>` or `<|return|>` (the last two are stop tokens, not in the text). The
    bodies of the analysis and commentary messages before the answer are the reasoning, one
    message per line. The answer is the `final` message's body, or, from the first message
    with a recipient on, the tool-call messages themselves (whole, for the `openai` tool
    parser). The markers are special tokens, so the output is decoded with them; a request's
    grammar starts after `<|channel|>final<|message|>`. An output that does not start with a
    header (a prompt that opened the final channel, or a model that ignored the format) is all
    answer."""

    name = "openai_gptoss"
    start = "<|channel|>"
    end = "<|channel|>final<|message|>"
    needs_special_tokens = True
    _body_end = re.compile(r"<\|(?:end|call|return|start|channel)\|>")

    def starts_thinking(self, prompt_tail, template_kwargs=None):
        return not prompt_tail.rstrip().endswith(self.end)

    def split(self, text, thinking, finished):
        lead = text.lstrip()
        if not thinking or (lead and not lead.startswith(("<|channel|>", "<|start|>"))
                            and not "<|channel|>".startswith(lead)):
            return Split(None, text)
        bodies, pos = [], 0
        while (m := text.find("<|message|>", pos)) >= 0:
            header, start = text[pos:m], m + len("<|message|>")
            if "<|channel|>final" in header:
                answer = text[start:]
                return Split("\n".join(bodies), answer or None if finished else answer)
            if "to=" in header:  # a tool call: the answer, from its header on
                return Split("\n".join(bodies), text[pos:])
            stop = self._body_end.search(text, start)
            if stop is None:
                body = text[start:]
                bodies.append(body if finished else body[:before_marker(body, "<|")])
                break
            bodies.append(text[start:stop.start()])
            # (the next header: after <|end|>, from its <|start|>)
            pos = stop.end() if stop.group() in ("<|end|>", "<|call|>", "<|return|>") \
                else stop.start()
        return Split("\n".join(bodies), None)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser,
                        DeepSeekV3ReasoningParser, GptOssReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"reasoning_parser={name!r} is not supported; use one of "
                         f"{', '.join(REASONING_PARSERS)}") from None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def before_marker(text: str, marker: str) -> int:
    """How much of a streamed text surely comes before `marker`: up to where it appears, or
    up to an end that may be its start (the rest is held back until the text is longer)."""
    i = text.find(marker)
    return i if i >= 0 else len(text) - _partial_suffix(text, marker)
