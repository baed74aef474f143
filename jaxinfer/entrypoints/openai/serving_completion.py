"""POST /v1/completions (vLLM's serving_completion): prompts as text or token ids (several per
request), n samples each, echo and prompt logprobs (lm-eval's loglikelihood), streamed or not.
A CompletionServing answers through the OpenAIServer it was given (its checks, admission and
engine)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxinfer.entrypoints.openai.errors import APIError, check_kv_transfer
from jaxinfer.entrypoints.openai.protocol import CompletionRequest
from jaxinfer.entrypoints.openai.streaming import DeltaTracker, guard, sse
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.validation import max_n_sequences


class CompletionServing:
    def __init__(self, server):
        self.server = server  # the OpenAIServer: its checks, admission, engine and model name

    async def create(self, req: CompletionRequest, raw: Request):
        self.server.check_model(req.model)
        params = self.server.sampling_params(req)
        await self.server.check_structured(req, params)
        prompts = await self._prompts(req.prompt, params)
        if req.kv_transfer_params is not None and len(prompts) != 1:
            raise APIError("kv_transfer_params needs a single prompt", 400, "kv_transfer_params")
        if len(prompts) * params.n > max_n_sequences():
            raise APIError(f"{len(prompts)} prompts x n={params.n} is {len(prompts) * params.n}"
                           f" sequences, more than the limit of {max_n_sequences()} per request "
                           "(JAXINFER_MAX_N_SEQUENCES)", 400, "n")
        for _, ids in prompts:
            self.server.check_prompt(ids)
            self.server.check_length(len(ids), params.max_tokens)
            self.server.check_min_tokens(len(ids), params)
        base = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        tickets = self.server.admit(len(prompts), params)
        gens = [self.server.run(ids, params, f"{base}-{i}", t, req)
                for i, ((_, ids), t) in enumerate(zip(prompts, tickets))]
        n = params.n
        usage_prompt = sum(len(ids) for _, ids in prompts)
        if not req.stream:
            outs = await self.server.with_disconnect(raw, self.server.collect(gens))
            choices = []
            for i, out in enumerate(outs):
                echo = (prompts[i][0] or self.server.llm.tokenizer.decode(prompts[i][1])) \
                    if req.echo else ""
                for c in out.outputs:
                    text = echo if req.prompt_only else echo + c.text
                    lps = None
                    if req.logprobs is not None:
                        lps = self._completion_logprobs(c, 0, len(echo), req)
                        if req.echo:
                            lps_p = self._prompt_logprobs(out, req)
                            if not req.prompt_only:
                                for key in lps_p:
                                    lps_p[key] += lps[key]
                            lps = lps_p
                    choices.append({"index": i * n + c.index, "text": text, "logprobs": lps,
                                    "finish_reason": "length" if req.prompt_only
                                    else c.finish_reason,
                                    "stop_reason": None if req.prompt_only else c.stop_reason,
                                    **self.server.prompt_logprobs(req, out)})
            completion = 0 if req.prompt_only else sum(
                len(c.token_ids) for o in outs for c in o.outputs)
            check_kv_transfer(outs)
            return {"id": base, "object": "text_completion", "created": created,
                    "model": self.server.response_model(req), "choices": choices,
                    "usage": {"prompt_tokens": usage_prompt, "completion_tokens": completion,
                              "total_tokens": usage_prompt + completion},
                    **self.server.kv_params(outs)}

        async def events():
            tracker = DeltaTracker(params.stop)
            echo_len: dict[int, int] = {}  # prompt -> length of its echoed text
            async for i, out in self.server.merge(gens):
                if req.echo and i not in echo_len:
                    # The prompt goes first, once its prefill is done (its logprobs then
                    # complete); with max_tokens=0 it is all there is.
                    if not any(c.token_ids or c.finish_reason for c in out.outputs):
                        continue
                    text = prompts[i][0] or self.server.llm.tokenizer.decode(prompts[i][1])
                    echo_len[i] = len(text)
                    lps = self._prompt_logprobs(out, req) if req.logprobs is not None else None
                    for k in range(n):
                        yield sse({"id": base, "object": "text_completion", "created": created,
                                    "model": self.server.response_model(req), "choices": [{
                                        "index": i * n + k, "text": text, "logprobs": lps,
                                        "finish_reason": "length" if req.prompt_only else None,
                                        "stop_reason": None}]})
                if req.prompt_only:
                    continue  # the one token generated to get there is not part of it
                for c in out.outputs:
                    d = tracker.next((i, c.index), c)
                    if d is None:
                        continue
                    yield sse({"id": base, "object": "text_completion", "created": created,
                                "model": self.server.response_model(req), "choices": [{
                                    "index": i * n + c.index, "text": d.text,
                                    "logprobs": self._completion_logprobs(
                                        c, d.start_tokens, d.start + echo_len.get(i, 0), req),
                                    "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason}]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": base, "object": "text_completion", "created": created,
                            "model": self.server.response_model(req), "choices": [],
                            "usage": {"prompt_tokens": usage_prompt,
                                      "completion_tokens": tracker.completion_tokens,
                                      "total_tokens": usage_prompt
                                      + tracker.completion_tokens}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(guard(events()), media_type="text/event-stream")

    async def _prompts(self, prompt, params) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt; the shape, count, lengths and token ids were
        checked by body.check_prompt. truncate_prompt_tokens applies to each."""
        truncate = params.truncate_prompt_tokens is not None
        cut = self.server.llm.processor.truncate
        if isinstance(prompt, str):
            return [(prompt, cut(await self.server.encode(prompt, truncate), params))]
        if isinstance(prompt[0], int):
            return [(None, cut(list(prompt), params))]
        if isinstance(prompt[0], str):
            return [(p, cut(await self.server.encode(p, truncate), params)) for p in prompt]
        return [(None, cut(list(p), params)) for p in prompt]

    @staticmethod
    def _namer(req):
        """How a logprob's token is shown: its text, or "token_id:<id>"
        (return_tokens_as_token_ids)."""
        if req.return_tokens_as_token_ids:
            return lambda tid, text: f"token_id:{tid}"
        return lambda tid, text: text

    def _prompt_logprobs(self, out: RequestOutput, req) -> dict:
        """echo + logprobs: the prompt's tokens with their logprobs (the first has none), in
        the completions logprobs shape, as vLLM returns them."""
        tok = self.server.llm.tokenizer
        name = self._namer(req)
        tokens, token_lps, tops, offsets = [], [], [], []
        off = 0
        for tid, d in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            text = tok.decode([tid])
            tokens.append(name(tid, text))
            offsets.append(off)
            off += len(text)
            if d is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(d[tid].logprob)
            tops.append({name(t, p.decoded_token): p.logprob for t, p in d.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _completion_logprobs(self, c: CompletionOutput, start: int, text_offset: int, req):
        if c.logprobs is None:
            return None
        name = self._namer(req)
        tokens, token_lps, tops, offsets = [], [], [], []
        off = text_offset
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = d[tid]
            tokens.append(name(tid, chosen.decoded_token))
            token_lps.append(chosen.logprob)
            tops.append({name(t, p.decoded_token): p.logprob for t, p in d.items() if t != tid
                         or len(d) == 1} | {name(tid, chosen.decoded_token): chosen.logprob})
            offsets.append(off)
            off += len(chosen.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}
