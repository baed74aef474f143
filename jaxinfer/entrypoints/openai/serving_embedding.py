"""A pooling model's routes (runner="pooling"), vLLM's: POST /v1/embeddings (OpenAI's
embeddings API plus vLLM's extras), POST /v1/score and /score, /rerank and /v1/rerank (the
cosine similarity of embeddings: an embedding model has no cross-encoder head; vLLM scores
embedding models so too)."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from types import SimpleNamespace
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.entrypoints.openai.body import check_prompt
from jaxinfer.entrypoints.openai.errors import APIError, validated
from jaxinfer.pooling import PoolingParams, finish
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.validation import INT32_MAX

MAX_SCORE_DOCUMENTS = 1024


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None  # (informational)
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    add_special_tokens: bool = True
    normalize: bool | None = None
    use_activation: bool | None = None
    priority: int = Field(0, ge=-(2**31), le=INT32_MAX)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    query: str
    documents: list[str] = Field(max_length=MAX_SCORE_DOCUMENTS)
    top_n: int | None = Field(None, ge=0, le=INT32_MAX)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)


class EmbeddingServing:
    def __init__(self, server):
        self.server = server

    async def _parse(self, raw, model, prompt_field: str | None = None):
        server = self.server

        def check(obj):
            if prompt_field is not None:
                check_prompt(obj, max_prompts=server.max_prompts_per_request,
                             vocab_size=server.llm.processor.vocab_size,
                             max_model_len=server.llm.max_model_len, field=prompt_field)

        return validated(model, await server.read_json(raw, check))

    async def _token_ids(self, texts, truncate: int | None, add_special_tokens: bool,
                         field: str) -> list[list[int]]:
        server, tok = self.server, self.server.llm.tokenizer
        if isinstance(texts, str) or (texts and isinstance(texts[0], int)):
            texts = [texts]
        out = []
        for i, t in enumerate(texts):
            if isinstance(t, str):
                if tok is None:
                    raise APIError(f"{field}: text needs a tokenizer (the server runs with "
                                   "--skip-tokenizer-init: send token ids)", 400, field)
                if add_special_tokens:
                    try:
                        ids = await server.encode(t, truncate is not None)
                    except APIError as e:  # (it names the completions field)
                        raise APIError(e.message, e.status, field) from None
                else:
                    ids = await asyncio.to_thread(tok.encode, t, False)
            else:
                ids = list(t)
            if truncate is not None:
                keep = server.llm.max_model_len if truncate == -1 else truncate
                ids = ids[-keep:] if keep else []
            if not ids:
                raise APIError(f"{field}[{i}]: an empty input has no embedding", 400, field)
            if len(ids) > server.llm.max_model_len:
                raise APIError(f"{field}[{i}] has {len(ids)} tokens, more than the model's "
                               f"maximum context length of {server.llm.max_model_len} tokens "
                               "(truncate_prompt_tokens cuts it)", 400, field)
            out.append(ids)
        return out

    async def _vectors(self, raw, prompts: list[list[int]], params: PoolingParams,
                       priority: int = 0) -> list[np.ndarray]:
        """Pool every prompt (one engine request each, batched by the scheduler)."""
        server = self.server
        sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        tickets = server.admit(len(prompts), sampling)
        base = f"embd-{uuid.uuid4().hex}"
        req = SimpleNamespace(model=None, priority=priority, cache_salt=None)  # (run() reads)
        gens = [server.run(ids, sampling, f"{base}-{i}", t, req)
                for i, (ids, t) in enumerate(zip(prompts, tickets))]
        outs = await server.with_disconnect(raw, server.collect(gens))
        pooler = server.llm.resolved.pooler
        vectors = []
        for out in outs:
            if out is None or out.pooled is None:
                raise APIError("the engine finished a request without its vector", 500, None)
            vectors.append(finish(np.frombuffer(out.pooled, np.float32), pooler, params))
        return vectors

    def _params(self, dimensions=None, normalize=None, use_activation=None) -> PoolingParams:
        try:
            params = PoolingParams(dimensions=dimensions, normalize=normalize,
                                   use_activation=use_activation)
            params.verify(self.server.llm.resolved.pooler)
        except ValueError as e:
            field = "dimensions" if "dimensions" in str(e) else "normalize"
            raise APIError(str(e), 400, field) from None
        return params

    async def embeddings(self, raw) -> dict:
        req = await self._parse(raw, EmbeddingRequest, "input")
        self.server.check_model(req.model)
        params = self._params(req.dimensions, req.normalize, req.use_activation)
        prompts = await self._token_ids(req.input, req.truncate_prompt_tokens,
                                        req.add_special_tokens, "input")
        vectors = await self._vectors(raw, prompts, params, req.priority)
        data = []
        for i, v in enumerate(vectors):
            emb = (base64.b64encode(v.astype("<f4").tobytes()).decode()
                   if req.encoding_format == "base64" else v.tolist())
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(p) for p in prompts)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.server.model_name, "data": data,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    async def _cosines(self, raw, queries: list[str], docs: list[str], truncate,
                       field: str) -> tuple[list[float], int]:
        texts = list(dict.fromkeys(queries + docs))  # (each distinct text pooled once)
        prompts = await self._token_ids(texts, truncate, True, field)
        vectors = await self._vectors(raw, prompts, PoolingParams(use_activation=True))
        at = dict(zip(texts, vectors))
        scores = [float(at[q] @ at[d]) for q, d in zip(queries, docs)]
        return scores, sum(len(p) for p in prompts)

    async def score(self, raw) -> dict:
        req = await self._parse(raw, ScoreRequest)
        self.server.check_model(req.model)
        left = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        right = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if len(left) == 1:
            left = left * len(right)
        if not right or len(left) != len(right):
            raise APIError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one "
                           "text_1, or as many as text_2", 400, "text_1")
        if len(right) > MAX_SCORE_DOCUMENTS:
            raise APIError(f"text_2 has {len(right)} texts, more than {MAX_SCORE_DOCUMENTS}",
                           400, "text_2")
        scores, n = await self._cosines(raw, left, right, req.truncate_prompt_tokens, "text_2")
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": self.server.model_name,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    async def rerank(self, raw) -> dict:
        req = await self._parse(raw, RerankRequest)
        self.server.check_model(req.model)
        if not req.documents:
            raise APIError("documents must not be empty", 400, "documents")
        scores, n = await self._cosines(raw, [req.query] * len(req.documents), req.documents,
                                        req.truncate_prompt_tokens, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": req.documents[i]}} if req.return_documents
                       else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.server.model_name,
                "results": results, "usage": {"total_tokens": n}}
