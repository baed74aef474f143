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
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
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
        for conv in conversations:
            ids = tok.apply_chat_template(conv, chat_template=chat_template, tokenize=True,
                                          add_generation_prompt=add_generation_prompt,
                                          **(chat_template_kwargs or {}))
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)
