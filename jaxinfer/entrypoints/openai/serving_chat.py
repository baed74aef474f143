"""POST /v1/chat/completions (vLLM's serving_chat): messages through the chat template, tools
(named / required calls constrained by structured outputs, auto calls found by a tool-call
parser), logprobs, streamed or not. A ChatServing answers through the OpenAIServer it was
given."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxinfer.entrypoints.openai.errors import APIError, check_kv_transfer
from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest
from jaxinfer.entrypoints.openai.streaming import DeltaTracker, guard, sse
from jaxinfer.entrypoints.openai.tools import (forced_tool_calls, make_tool_call_id,
                                               messages_for_template, named_tool,
                                               template_renders_tools)
from jaxinfer.outputs import CompletionOutput


class _Text(NamedTuple):
    """One part of a choice's output (its answer or its thinking) as DeltaTracker reads it."""

    text: str
    token_ids: Any
    finish_reason: str | None
    index: int


class ChatServing:
    def __init__(self, server):
        self.server = server  # the OpenAIServer: its checks, admission, engine and model name

    async def create(self, req: ChatCompletionRequest, raw: Request, info: dict | None = None):
        """info: filled with the prompt's token count (for the Messages route's stream)."""
        self.server.check_model(req.model)
        params = self.server.sampling_params(req)
        await self.server.check_structured(req, params)
        mode = self._tool_mode(req)
        reasoning = self.server.llm.processor.reasoning
        if (mode == "auto" and self.server.tool_parser.special_tokens) or (
                reasoning is not None and reasoning.needs_special_tokens):
            params = params.clone(skip_special_tokens=False)  # (the calls' / channels' markers)
        images = await self.load_images(req, params)
        ids, template_kwargs = await self.render(req, params.truncate_prompt_tokens is not None)
        ids = self.server.llm.processor.truncate(ids, params)
        # (with images: the prompt as the engine sees it, each placeholder expanded)
        full, image_tokens = ids, 0
        if images:
            mm = self.server.llm.processor.multimodal
            try:
                full = mm.expand(ids, images)
                image_tokens = sum(mm.check_image(im) for im in images)
            except ValueError as e:
                raise APIError(f"messages: {e}", 400, "messages") from None
        if info is not None:
            info["prompt_tokens"] = len(full)
        self.server.check_prompt(full, image_tokens)
        asked = req.max_tokens or req.max_completion_tokens
        self.server.check_length(len(full), params.max_tokens if asked else None)
        room = self.server.llm.max_model_len - len(full)
        if not asked and params.max_tokens is not None and params.max_tokens > room:
            params = params.clone(max_tokens=max(room, 1))  # (a generation-config default)
        self.server.check_min_tokens(len(full), params)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        processor = self.server.llm.processor
        # A reasoning model's thinking (--reasoning-parser): where each choice's output starts.
        thinking = processor.starts_thinking(ids, template_kwargs) \
            if processor.reasoning is not None else None
        (ticket,) = self.server.admit(1, params)
        gen = self.server.run(ids, params, base, ticket, req,
                              chat_template_kwargs=template_kwargs,
                              multi_modal_data={"image": images} if images else None)
        top_n = req.top_logprobs or 0
        if not req.stream:
            (out,) = await self.server.with_disconnect(raw, self.server.collect([gen]))
            completion = sum(len(c.token_ids) for c in out.outputs)
            choices = []
            for c in out.outputs:
                message, finish = self._chat_message(req, mode, c, thinking)
                choices.append({"index": c.index, "message": message,
                                "logprobs": self._chat_logprobs(c, 0, top_n, req),
                                "finish_reason": finish, "stop_reason": c.stop_reason})
            check_kv_transfer([out])
            return {"id": base, "object": "chat.completion", "created": created,
                    "model": self.server.response_model(req), "choices": choices,
                    "usage": {"prompt_tokens": len(full), "completion_tokens": completion,
                              "total_tokens": len(full) + completion},
                    **self.server.prompt_logprobs(req, out), **self.server.kv_params([out])}

        def chunk(choices, **extra):
            return sse({"id": base, "object": "chat.completion.chunk", "created": created,
                         "model": self.server.response_model(req), "choices": choices, **extra})

        async def events():
            tracker = DeltaTracker(params.stop)
            thoughts = DeltaTracker(params.stop)  # the reasoning text sent, per choice
            answer_at: dict[int, tuple] = {}  # choice -> (its thinking, where its answer starts)

            def split(c, done):
                """(thinking, answer or None) of a choice's text so far; once the answer has
                started its start is known, so later chunks do not scan the text again."""
                known = answer_at.get(c.index)
                if known is not None:
                    return known[0], c.text[known[1]:]
                thought, answer = processor.reasoning.split(c.text, thinking, done)
                if answer is not None:
                    answer_at[c.index] = (thought, len(c.text) - len(answer))
                return thought, answer
            call_ids: dict[int, str] = {}
            for k in range(params.n):
                yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            named = named_tool(req.tool_choice) if mode == "forced" else None
            async for _, out in self.server.merge([gen]):
                for c in out.outputs:
                    done = c.finish_reason is not None
                    thought = None
                    if thinking is not None:  # the answer is what follows the thinking
                        thought, answer = split(c, done)
                        c_all, c = c, _Text(answer or "", c.token_ids, c.finish_reason,
                                            c.index)
                    limit = None
                    if mode == "auto":  # a call may be starting: hold it back (at the end,
                        # what follows the calls' start goes out below, as calls or content)
                        limit = self.server.tool_parser.safe_prefix(c.text)
                    elif mode == "forced" and named is None:  # required: the calls at the end
                        limit = 0
                    d = tracker.next(c.index, c, limit)
                    if d is None:
                        continue
                    if thinking is not None:
                        dr = thoughts.next(c.index, _Text(thought or "", c.token_ids,
                                                          c.finish_reason, c.index))
                        c = c_all
                    piece, t0, k0 = d.text, d.start, d.start_tokens
                    finish = c.finish_reason
                    delta: dict[str, Any] = {}
                    if named is not None:  # the arguments, as they come
                        if t0 == 0 and (piece or done):
                            call_ids[c.index] = make_tool_call_id()
                            delta["tool_calls"] = [{"index": 0, "id": call_ids[c.index],
                                                    "type": "function", "function": {
                                                        "name": named, "arguments": piece}}]
                        elif piece:
                            delta["tool_calls"] = [{"index": 0,
                                                    "function": {"arguments": piece}}]
                    elif piece:
                        delta["content"] = piece
                    if thinking is not None and dr is not None and dr.text \
                            and req.include_reasoning:
                        delta = {"reasoning": dr.text, "reasoning_content": dr.text, **delta}
                    if done and mode != "none" and named is None:
                        message, finish = self._chat_message(req, mode, c, thinking)
                        calls = message.get("tool_calls")
                        if calls:
                            delta["tool_calls"] = [{"index": i, **call}
                                                   for i, call in enumerate(calls)]
                            rest = (message["content"] or "")[tracker.sent(c.index):]
                        else:
                            answer = c.text if thinking is None else split(c, True)[1] or ""
                            rest = answer[tracker.sent(c.index):]
                        if rest:
                            delta["content"] = delta.get("content", "") + rest
                    yield chunk([{"index": c.index, "delta": delta,
                                  "logprobs": self._chat_logprobs(c, k0, top_n, req),
                                  "finish_reason": finish, "stop_reason": c.stop_reason}])
            if req.stream_options and req.stream_options.include_usage:
                completion = tracker.completion_tokens
                yield chunk([], usage={"prompt_tokens": len(ids), "completion_tokens": completion,
                                       "total_tokens": len(ids) + completion})
            yield "data: [DONE]\n\n"

        return StreamingResponse(guard(events()), media_type="text/event-stream")

    # -- chat -----------------------------------------------------------------------------------
    async def load_images(self, req: ChatCompletionRequest, params) -> list:
        """The request's image_url parts as PIL images (decoded off the event loop); a 400
        naming the part when one cannot be used."""
        parts = req.image_urls
        if not parts:
            return []
        mm = self.server.llm.processor.multimodal
        if mm is None:
            raise APIError(f"{parts[0][0]}: an 'image_url' content part cannot be used: this "
                           "model takes text only", 400, parts[0][0])
        limit = mm.limits.get("image", 0)
        if len(parts) > limit:
            raise APIError(f"messages: {len(parts)} images, more than the limit of {limit} per "
                           "prompt (--limit-mm-per-prompt)", 400, "messages")
        if params.truncate_prompt_tokens is not None:
            raise APIError("truncate_prompt_tokens cannot be combined with images (it could "
                           "cut an image's tokens)", 400, "truncate_prompt_tokens")
        from jaxinfer.multimodal.media import load_image_url

        images = []
        for where, url in parts:
            try:
                image = await asyncio.to_thread(load_image_url, url,
                                                self.server.allowed_local_media_path)
                mm.check_image(image)
            except ValueError as e:
                raise APIError(f"{where}: {e}", 400, where) from None
            images.append(image)
        return images

    async def render(self, req: ChatCompletionRequest, truncating: bool = False,
                     add_special_tokens: bool = False) -> tuple[list[int], dict]:
        """The request's messages through the chat template: (token ids, the template's
        kwargs). Also /tokenize's (add_special_tokens: on top of what the template places)."""
        if req.chat_template is not None and not self.server.trust_request_chat_template:
            raise APIError("chat_template: a chat template passed with the request is not "
                           "rendered unless the server runs with --trust-request-chat-template "
                           "(a template is code)", 400, "chat_template")
        fmt = "openai" if self.server.content_format == "openai" else "string"
        mm = self.server.llm.processor.multimodal
        conversation = messages_for_template(req.conversation(
            fmt, mm.placeholder_text if mm is not None else ""))
        chars = sum(len(m["content"]) if isinstance(m["content"], str)
                    else sum(len(p.get("text") or "") for p in m["content"])
                    for m in conversation)
        limit = self.server.llm.max_model_len
        at_least = chars // self.server.llm.tokenizer.max_token_chars
        if at_least > limit and not truncating:
            # refused without rendering or tokenizing it
            raise APIError(f"The messages have at least {at_least} tokens ({chars} characters), "
                           f"longer than the model's maximum context length of {limit} tokens.",
                           400, "messages")
        tok = self.server.llm.tokenizer
        try:
            template_kwargs = {**self.server.default_chat_template_kwargs,
                               **(req.chat_template_kwargs or {})}
            extra = dict(template_kwargs)
            if req.tools:
                extra["tools"] = req.tools
            if req.documents is not None:
                extra["documents"] = req.documents

            def render():
                text = tok.apply_chat_template(
                    conversation, chat_template=req.chat_template or self.server.chat_template,
                    add_generation_prompt=req.add_generation_prompt, tokenize=False,
                    continue_final_message=req.continue_final_message, **extra)
                return tok.encode(text, add_special_tokens=add_special_tokens)

            ids = await asyncio.to_thread(render)
        except Exception as e:  # template errors are the request's fault
            raise APIError(f"could not render the chat template: {e}", 400, "messages") from None
        return ids, template_kwargs

    def _chat_logprobs(self, c: CompletionOutput, start: int, top_n: int, req=None):
        if c.logprobs is None:
            return None
        as_ids = req is not None and bool(req.return_tokens_as_token_ids)

        def name(tid, p):  # its text, or "token_id:<id>" (return_tokens_as_token_ids)
            return f"token_id:{tid}" if as_ids else p.decoded_token or ""

        content = []
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = d[tid]
            tok = name(tid, chosen)
            tops = sorted(d.items(), key=lambda kv: kv[1].rank or 0)[:top_n]
            content.append({"token": tok, "logprob": chosen.logprob,
                            "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": name(t, p), "logprob": p.logprob,
                                              "bytes": list(name(t, p).encode())}
                                             for t, p in tops]})
        return {"content": content}

    def _tool_mode(self, req: ChatCompletionRequest) -> str:
        """ "none" (plain text), "forced" (named / required: the output is the calls) or
        "auto" (a parser looks for calls in the text)."""
        if req.forced_tool_choice:
            return "forced"
        if req.tool_choice == "auto" and req.tools:
            if self.server.tool_parser is None:
                raise APIError('tool_choice="auto" (the default when tools are given) requires '
                               "--enable-auto-tool-choice and --tool-call-parser to be set",
                               400, "tool_choice")
            template = req.chat_template or self.server.llm.tokenizer.chat_template
            if not template_renders_tools(template):
                raise APIError("tool_choice='auto': the chat template does not render tools, "
                               "so the model would never see them; pass a chat_template that "
                               "does, or use tool_choice='required' / a named function", 400,
                               "tools")
            return "auto"
        return "none"

    def _chat_message(self, req, mode: str, c: CompletionOutput, thinking: bool | None = None
                      ) -> tuple[dict, str | None]:
        """The assistant message and finish_reason of one finished choice (`thinking`: under
        a reasoning parser, whether the output started in the thinking section)."""
        text, finish = c.text, c.finish_reason
        reasoning = None
        if thinking is not None:
            reasoning, text = self.server.llm.processor.reasoning.split(text, thinking, True)
            text = text or ""
        calls: list[dict] = []
        content: str | None = text if text or thinking is None else None
        if mode == "forced":
            try:
                calls = forced_tool_calls(text, req.tool_choice)
                content = None
            except (ValueError, KeyError, TypeError):  # cut short (length): not a whole call
                calls = []
        elif mode == "auto":
            content, calls = self.server.tool_parser.parse(text, req._tools)
        if calls and req.parallel_tool_calls is False:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking is not None and req.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
            if finish == "stop" and (mode == "auto" or req.tool_choice == "required"):
                finish = "tool_calls"
        return message, finish
