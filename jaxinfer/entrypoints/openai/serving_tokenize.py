"""vLLM's /tokenize and /detokenize (a prompt or a chat through the template, token ids back
to text), with vLLM's request and response fields."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.entrypoints.openai.errors import APIError, validated
from jaxinfer.entrypoints.openai.protocol import ChatCompletionRequest

MAX_DETOKENIZE_TOKENS = 1 << 20  # ids in one /detokenize body (a few MB of JSON)


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # (on top of what the template places)
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeServing:
    def __init__(self, server):
        self.server = server

    async def tokenize(self, raw) -> dict:
        obj = await self.server.read_json(raw)
        server, tok = self.server, self.server.llm.tokenizer
        if tok is None:
            raise APIError("this server runs without a tokenizer (--skip-tokenizer-init)", 400,
                           None)
        if "messages" in obj:
            req = validated(TokenizeChatRequest, obj)
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError("Cannot set both `continue_final_message` and "
                               "`add_generation_prompt` to True.", 400,
                               "continue_final_message")
            server.check_model(req.model)
            fields = req.model_dump(exclude={"add_special_tokens", "return_token_strs"},
                                    exclude_none=True)
            chat = validated(ChatCompletionRequest, fields)
            ids, _ = await server.chat.render(chat, add_special_tokens=req.add_special_tokens)
        else:
            req = validated(TokenizeCompletionRequest, obj)
            server.check_model(req.model)
            limit = server.llm.max_model_len
            # (bounded as a prompt is: no tokenizing megabytes for a count)
            at_least = len(req.prompt) // tok.max_token_chars
            if at_least > 16 * limit:
                raise APIError(f"prompt: at least {at_least} tokens, more than /tokenize "
                               f"counts (16 x the maximum context length of {limit})", 400,
                               "prompt")
            ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        strs = None
        if req.return_token_strs:
            strs = tok.convert_ids_to_tokens(ids)
        return TokenizeResponse(count=len(ids), max_model_len=server.llm.max_model_len,
                                tokens=ids, token_strs=strs).model_dump()

    async def detokenize(self, raw) -> dict:
        obj = await self.server.read_json(raw)
        server, tok = self.server, self.server.llm.tokenizer
        if tok is None:
            raise APIError("this server runs without a tokenizer (--skip-tokenizer-init)", 400,
                           None)
        req = validated(DetokenizeRequest, obj)
        server.check_model(req.model)
        vocab = server.llm.processor.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens[{bad}]: token id {req.tokens[bad]} is out of the "
                           f"vocabulary [0, {vocab})", 400, "tokens")
        text = await asyncio.to_thread(tok.decode, req.tokens)
        return DetokenizeResponse(prompt=text).model_dump()
