"""The offline facade, vLLM-compatible: LLM(model).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An offline engine. `model=None` runs the embedded SmolLM2-135M-Instruct.

    Options follow vLLM where they apply: dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, enable_prefix_caching, enable_chunked_prefill, seed,
    load_format, attention_backend (default "auto": the C++ "cpu" kernels on CPU devices where
    they build, else "xla"; "pallas" | "reference"), tensor_parallel_size, the KV-cache size (gpu_memory_utilization, num_kv_blocks or kv_cache_memory_bytes), and
    skip_tokenizer_init (token-id prompts in, token ids out: no tokenizer is loaded),
    enable_multiprocessing (default: the engine core in a child process; env var
    JAXINFER_ENABLE_MULTIPROCESSING=0 turns it off), async_scheduling, and multi-LoRA
    serving (enable_lora, max_loras, max_lora_rank, max_cpu_loras; generate / chat take
    lora_request=LoRARequest(...)).
    """

    def __init__(self, model: str | None = None, **kwargs):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {unknown}; known: {sorted(fields)}")
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._paused = False
        self._counter = 0
        if self.llm_engine.is_worker:  # multi-host: replay process 0's steps until shutdown
            self.llm_engine.run_worker_loop()

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        """An LLM of a whole EngineConfig (the command line builds one: config/cli.py)."""
        kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)
                  if f.init}
        return cls(kwargs.pop("model"), **kwargs)

    def shutdown(self) -> None:
        """Stop the engine core: its process, or (multi-host) release the worker processes
        blocked in LLM(). Also done when the LLM is garbage-collected or Python exits."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json defaults (generation_config="auto"),
        else SamplingParams()'s own; used when generate / chat get no sampling_params."""
        return SamplingParams(**self.llm_engine.resolved.default_sampling)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in input order. lora_request:
        a LoRARequest for every prompt, or a list of one (or None) per prompt (enable_lora)."""
        if self.llm_engine.is_worker:
            raise RuntimeError("this is a multi-host worker process: generate on process 0")
        if self._paused:  # (its requests would wait for a resume that cannot come)
            raise RuntimeError("generation is paused (pause_generation / sleep): call "
                               "resume_generation() or wake_up() first")
        if self.llm_engine.resolved.runner == "pooling":
            raise ValueError("this LLM runs a pooling model (runner='pooling'): use "
                             "LLM.embed / LLM.encode / LLM.score, not generate")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        else:
            loras = [lora_request] * len(prompts)
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.llm_engine.add_request(rid, prompt, p,
                                            priority=priority[i] if priority else 0,
                                            lora_request=loras[i])
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)  # nothing half-submitted stays behind
            raise
        return self._run(ids, use_tqdm)

    # -- pooling models (runner="pooling") -------------------------------------------------
    def encode(self, prompts, pooling_params=None, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, lora_request=None) -> list:
        """Each prompt's pooled vector (vLLM's LLM.encode): PoolingRequestOutput with
        outputs.data a float32 numpy array (after pooling_params: Matryoshka dimensions,
        normalization). pooling_params: one PoolingParams for all prompts or one per prompt."""
        from jaxinfer.pooling import PoolingOutput, PoolingRequestOutput

        outs, params, pooler = self._pool(prompts, pooling_params, truncate_prompt_tokens,
                                          use_tqdm, lora_request)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(_finish(o, pooler, p)),
                                     o.prompt_token_ids, True, o.num_cached_tokens, o.prompt)
                for o, p in zip(outs, params)]

    def embed(self, prompts, pooling_params=None, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, lora_request=None) -> list:
        """Each prompt's embedding (vLLM's LLM.embed): EmbeddingRequestOutput with
        outputs.embedding a list of floats."""
        from jaxinfer.pooling import EmbeddingOutput, EmbeddingRequestOutput

        outs, params, pooler = self._pool(prompts, pooling_params, truncate_prompt_tokens,
                                          use_tqdm, lora_request)
        return [EmbeddingRequestOutput(o.request_id,
                                       EmbeddingOutput(_finish(o, pooler, p).tolist()),
                                       o.prompt_token_ids, True, o.num_cached_tokens, o.prompt)
                for o, p in zip(outs, params)]

    def score(self, text_1, text_2, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list:
        """vLLM's LLM.score with an embedding model: the cosine similarity of text_1's and
        each of text_2's embeddings (one text_1 against many, or pairs of equal lists)."""
        from jaxinfer.pooling import PoolingParams, ScoringOutput, ScoringRequestOutput

        left = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
        right = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right) or not right:
            raise ValueError(f"score: text_1 has {len(left)} items and text_2 {len(right)}: "
                             "give one text_1, or as many as text_2")
        unit = PoolingParams(use_activation=True)
        embs = self.embed(left + right, unit, truncate_prompt_tokens=truncate_prompt_tokens,
                          use_tqdm=use_tqdm)
        n = len(right)
        out = []
        for i in range(n):
            a, b = embs[i].outputs.embedding, embs[n + i].outputs.embedding
            score = float(sum(x * y for x, y in zip(a, b)))
            out.append(ScoringRequestOutput(f"score-{i}", ScoringOutput(score),
                                            embs[i].prompt_token_ids
                                            + embs[n + i].prompt_token_ids))
        return out

    def _pool(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request):
        from jaxinfer.pooling import PoolingParams

        rc = self.llm_engine.resolved
        if rc.runner != "pooling":
            raise ValueError("LLM.embed / encode / score need a pooling model: "
                             "LLM(model, runner='pooling')")
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} PoolingParams for {len(prompts)} prompts")
        for p in params:
            if p is not None:
                p.verify(rc.pooler)
        sampling = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                   truncate_prompt_tokens=truncate_prompt_tokens
                                   if p is None or p.truncate_prompt_tokens is None
                                   else p.truncate_prompt_tokens) for p in params]
        ids = []
        try:
            for prompt, sp in zip(prompts, sampling):
                rid = f"pool-{self._counter}"
                self._counter += 1
                self.llm_engine.add_request(rid, prompt, sp, lora_request=lora_request)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm), params, rc.pooler

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        t0, num_out = time.perf_counter(), 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_out += sum(len(o.token_ids) for o in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            dt = time.perf_counter() - t0
                            bar.set_postfix_str(f"output {num_out / max(dt, 1e-9):.1f} tok/s")
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, lora_request=None
             ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs the tokenizer's chat template, but this LLM was "
                             "started with skip_tokenizer_init=True")
        prompts = []
        mm = self.llm_engine.processor.multimodal
        for conv in conversations:
            conv, images = chat_images(conv, mm.placeholder_text if mm is not None else None)
            ids = tok.apply_chat_template(conv, chat_template=chat_template, tokenize=True,
                                          add_generation_prompt=add_generation_prompt,
                                          **(chat_template_kwargs or {}))
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            prompt = {"prompt_token_ids": list(ids)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    # -- RL rollouts: pause / resume, weight updates, sleep / wake up (docs/rl.md) -------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating (between generate calls nothing is in flight; requests another
        thread submitted through llm_engine end, finish or stay parked as `mode` says);
        generate refuses until resume_generation."""
        state = self.llm_engine.pause_generation(mode, clear_cache)
        while state == "draining":  # ("wait": run what is in flight to its end)
            self.llm_engine.step()
            state = self.llm_engine.call_utility("get_pause_state")
        self._paused = True

    def resume_generation(self) -> None:
        self.llm_engine.resume_generation()
        self._paused = False

    def is_paused(self) -> bool:
        return self.llm_engine.is_paused()

    def update_weights(self, weights, *, layout: str = "hf",
                       weight_version: str | None = None) -> dict:
        """Swap in new weights between two steps, all or nothing: `weights` maps HF
        checkpoint names (layout="hf") or the engine's parameter paths (layout="engine",
        no copy for arrays already sharded as the engine's) to arrays. Needs the engine
        core in this process (enable_multiprocessing=False). The prefix cache is reset;
        weight_version labels the tokens sampled from now on (default: the update count).
        Returns what it did (tensors, bytes, seconds, arrays taken without a copy)."""
        return self.llm_engine.update_weights(weights, layout=layout,
                                              weight_version=weight_version)

    def update_weights_from_path(self, path: str, weight_version: str | None = None) -> dict:
        """New weights from a safetensors folder (works with the core in its own process)."""
        return self.llm_engine.update_weights_from_path(path, weight_version)

    def update_weights_from_transfer(self, payload: dict,
                                     weight_version: str | None = None) -> dict:
        """Pull the weights a trainer's WeightSender offered (jaxinfer.weight_transfer) over
        JAX's transfer API: another process or host, no file (any process setup)."""
        return self.llm_engine.update_weights_from_transfer(payload, weight_version)

    def reload_weights(self, weight_version: str | None = None) -> dict:
        """The model's own checkpoint again (after sleep level 2)."""
        return self.llm_engine.reload_weights(weight_version)

    def get_weight_version(self) -> str:
        return self.llm_engine.get_weight_version()

    def set_weight_version(self, weight_version: str) -> None:
        self.llm_engine.set_weight_version(weight_version)

    def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """vLLM's LLM.sleep (enable_sleep_mode=True for levels 1 and 2): level 1 keeps the
        weights in host memory and frees them and the KV cache on the device; level 2 frees
        both (wake_up, then update_weights or reload_weights). Generation is paused until
        wake_up."""
        if mode == "wait":
            self.pause_generation("wait", clear_cache=level >= 1)
        result = self.llm_engine.sleep(level, mode)
        self._paused = True
        return result

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back tags ("weights", "kv_cache"; None: all); True once fully awake."""
        awake = self.llm_engine.wake_up(tags)
        self._paused = not awake
        return awake

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """Call a method of the engine's worker (by name; a callable, called with the worker,
        when the core runs in this process); one result per worker."""
        if timeout is not None:
            raise ValueError("collective_rpc: timeout is not supported (the call runs "
                             "between two steps of the engine core)")
        return self.llm_engine.collective_rpc(method, args, kwargs)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _finish(out: RequestOutput, pooler, params):
    """A finished pooling request's vector, as its PoolingParams ask."""
    import numpy as np

    from jaxinfer.pooling import finish

    if out.pooled is None:  # (aborted / failed before its prompt was done)
        reason = out.outputs[0].finish_reason if out.outputs else None
        raise RuntimeError(f"request {out.request_id} ended ({reason}) without its vector")
    return finish(np.frombuffer(out.pooled, np.float32), pooler, params)


def chat_images(conv, placeholder: str | None):
    """A conversation whose messages may hold OpenAI content parts -> (the conversation with
    each content list as one string, each image written as the model's `placeholder`; the
    images in order). Parts: text, image_url (a data: URL) and image_pil (vLLM's offline
    part: {"type": "image_pil", "image_pil": PIL image})."""
    from jaxinfer.multimodal.media import load_image_url

    out, images = [], []
    for i, msg in enumerate(conv):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        text = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(str(part.get("text", "")))
                continue
            if kind not in ("image_url", "image_pil"):
                raise ValueError(f"{where}: content parts of type {kind!r} are not supported "
                                 "(text, image_url, image_pil)")
            if placeholder is None:
                raise ValueError(f"{where}: this model takes text only")
            try:
                if kind == "image_pil":
                    image = part.get("image_pil")
                    from PIL import Image

                    if not isinstance(image, Image.Image):
                        raise ValueError("image_pil must be a PIL image")
                else:
                    url = (part.get("image_url") or {}).get("url")
                    if isinstance(url, str) and url.startswith("file:"):
                        raise ValueError("file:// URLs are read by the server only (with "
                                         "--allowed-local-media-path); offline, pass an "
                                         "image_pil part or a data: URL")
                    image = load_image_url(url)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            images.append(image)
            text.append(placeholder)
        out.append({**msg, "content": "".join(text)})
    return out, images
