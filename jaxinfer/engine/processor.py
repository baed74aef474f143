"""Processor: user prompt + SamplingParams -> validated, tokenized EngineCoreRequest(s).

Everything the engine core would refuse is refused here, with the field and the limit named:
the core (maybe in another process) then never has to reject a request."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from jaxinfer.engine.messages import EngineCoreRequest
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams
from jaxinfer.validation import (INT64_MAX, INT64_MIN, FieldError, check_cache_salt,
                                 check_extra_args, check_for_model, check_int)

PromptType = str | dict[str, Any] | list[int]
# A prompt dict's keys (vLLM's TextPrompt / TokensPrompt)
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"})


class Processor:
    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int,
                 eos_token_id: int | None, extra_eos_token_ids: tuple[int, ...] = (),
                 seed: int = 0, num_usable_kv_blocks: int | None = None, block_size: int = 16,
                 structured_outputs_config=None, reasoning_parser: str | None = None,
                 logits_processors=None, enable_lora: bool = False,
                 placeholder_token_ids: tuple[int, ...] = (), multimodal=None):
        self.tokenizer = tokenizer
        # A vision-language model's image / video placeholder tokens: a prompt holds them
        # only where its images' embeddings go (placed by `multimodal`, the model's
        # MultiModalProcessor: None for text-only models).
        self.placeholder_token_ids = frozenset(placeholder_token_ids)
        self.multimodal = multimodal
        self.enable_lora = enable_lora
        # Custom logits processors' classes: each checks a request's params; their extra_args
        # keys are the ones a request may use beside kv_transfer_params.
        from jaxinfer.logits_processors import load_processor

        self.logits_processors = [load_processor(p) for p in logits_processors or ()]
        self.extra_args_keys = frozenset(k for c in self.logits_processors
                                         for k in c.extra_args_keys)
        # A reasoning model's thinking section (jaxinfer/reasoning.py): the split of the chat
        # route's text, and where a request's grammar starts.
        self.reasoning = None
        self._reasoning_end_ids: list[int] = []
        if reasoning_parser is not None and tokenizer is not None:
            from jaxinfer.reasoning import get_reasoning_parser

            self.reasoning = get_reasoning_parser(reasoning_parser)
            self._reasoning_end_ids = tokenizer.encode(self.reasoning.end,
                                                       add_special_tokens=False)
        self.structured_outputs_config = structured_outputs_config
        self._so_validator = None
        self._so_checked: dict[str, str] = {}  # spec key -> backend (validated specs)
        self.num_usable_kv_blocks = num_usable_kv_blocks  # None: not checked
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = tuple(t for t in extra_eos_token_ids if t != eos_token_id)
        self._rng = random.Random(seed)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs the tokenizer, but the engine was "
                                 "started with skip_tokenizer_init=True; pass "
                                 "{'prompt_token_ids': [...]} instead")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompt: unsupported key(s) {unknown} (supported: "
                                 f"{', '.join(sorted(PROMPT_KEYS))})")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self.tokenize_prompt(str(prompt["prompt"]))
            raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, (list, tuple)) and all(isinstance(i, int) for i in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: use a string, "
                         "{'prompt': str} or {'prompt_token_ids': [int, ...]}")

    def check_params(self, params: SamplingParams) -> None:
        """The limits that depend on this model (vocabulary, context): FieldError naming the
        field."""
        check_for_model(params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        check_extra_args(params, self.extra_args_keys)
        for cls in self.logits_processors:
            cls.validate_params(params)

    def tokenize_bad_words(self, words) -> list[list[int]]:
        """Each bad word as token ids, as written (leading spaces dropped) and, where the
        tokenizer has a separate form for it, after a space (mid-text), as vLLM does."""
        if self.tokenizer is None:
            raise FieldError("bad_words", "bad_words need the tokenizer, but the engine was "
                                          "started with skip_tokenizer_init=True; pass "
                                          "bad_words_token_ids instead")
        out: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(alone)
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return [w for w in out if w]

    def truncate(self, ids: list[int], params: SamplingParams | None) -> list[int]:
        """truncate_prompt_tokens: keep the prompt's last k tokens (vLLM's left truncation)."""
        t = params.truncate_prompt_tokens if params is not None else None
        if t is None:
            return ids
        k = self.max_model_len if t == -1 else t
        return ids[-k:] if len(ids) > k else ids

    def process_multimodal(self, prompt: PromptType, ids: list[int],
                           params: SamplingParams) -> tuple[list[int], list]:
        """A prompt's images (its multi_modal_data): the prompt with their placeholders
        expanded, and their features; ([], ids) without images."""
        if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
            return ids, []
        if self.multimodal is None:
            raise ValueError("multi_modal_data: this model takes text only (no vision "
                             "encoder)")
        from jaxinfer.multimodal.inputs import image_list

        images = image_list(prompt["multi_modal_data"])
        if not images:
            return ids, []
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be combined with images (it "
                             "could cut an image's tokens)")
        return self.multimodal.process(ids, images)

    def validate_prompt(self, ids: list[int], image_tokens: int = 0) -> None:
        """image_tokens: how many of the prompt's tokens its images' embeddings replace."""
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, longer than max_model_len="
                             f"{self.max_model_len}")
        if self.num_usable_kv_blocks is not None:
            need = -(-(len(ids) + 1) // self.block_size)
            if need > self.num_usable_kv_blocks:
                raise ValueError(f"the request needs {need} KV blocks, more than the whole "
                                 f"cache ({self.num_usable_kv_blocks} blocks)")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of vocabulary "
                             f"[0, {self.vocab_size})")
        if self.placeholder_token_ids and not self.placeholder_token_ids.isdisjoint(ids):
            if sum(i in self.placeholder_token_ids for i in ids) != image_tokens:
                bad = next(i for i in ids if i in self.placeholder_token_ids)
                raise ValueError(f"prompt token id {bad} is the model's image / video "
                                 "placeholder, but no image of the request's "
                                 "multi_modal_data goes there (pass the images as "
                                 "multi_modal_data, one placeholder per image)")

    def validate_structured_outputs(self, so: StructuredOutputsParams) -> str:
        """The backend that will run `so`; ValueError naming the problem otherwise. Builds the
        grammar backend's tokenizer on first use (about half a second): async callers run it
        in a thread."""
        from jaxinfer.config import StructuredOutputsConfig
        from jaxinfer.structured_output.limits import check_spec_limits

        config = self.structured_outputs_config or StructuredOutputsConfig()
        check_spec_limits(so, max_spec_bytes=config.max_spec_bytes,
                          max_schema_depth=config.max_schema_depth)
        key = so.key()
        backend = self._so_checked.get(key)
        if backend is not None:
            return backend
        if self.tokenizer is None:
            raise ValueError("structured_outputs need the tokenizer, but the engine was started "
                             "with skip_tokenizer_init=True")
        if self._so_validator is None:
            from jaxinfer.config import StructuredOutputsConfig
            from jaxinfer.structured_output import StructuredOutputValidator

            tok = self.tokenizer
            self._so_validator = StructuredOutputValidator(
                self.structured_outputs_config or StructuredOutputsConfig(),
                lambda: (tok.backend_json(), self.eos_token_id), self.vocab_size)
        backend = self._so_validator.validate(so)
        if len(self._so_checked) >= 1024:
            self._so_checked.pop(next(iter(self._so_checked)))
        self._so_checked[key] = backend
        return backend

    def starts_thinking(self, prompt_ids: list[int], template_kwargs: dict | None = None
                        ) -> bool:
        """Under a reasoning parser: the output of this prompt starts inside the thinking
        section (read from the prompt's last tokens and, when known, the chat-template
        variables)."""
        if self.reasoning is None:
            return False
        from jaxinfer.reasoning import PROMPT_TAIL_TOKENS

        tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return self.reasoning.starts_thinking(tail, template_kwargs)

    def make_requests(self, request_id: str, prompt: PromptType,
                      params: SamplingParams | None, *, arrival_time: float | None = None,
                      priority: int = 0, cache_salt: str | None = None,
                      chat_template_kwargs: dict | None = None, lora_request=None
                      ) -> tuple[str | None, list[int], list[EngineCoreRequest]]:
        """One Request per sample (n > 1 fans out into children sharing the prompt)."""
        params = params or SamplingParams()
        self.check_lora(lora_request)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop: stop strings need the tokenizer, but the engine was started "
                             "with skip_tokenizer_init=True; use stop_token_ids")
        if params.bad_words:
            params = params.clone(bad_words_token_ids=self.tokenize_bad_words(params.bad_words))
        self.check_params(params)
        check_int("", "priority", priority, INT64_MIN, INT64_MAX)
        if isinstance(prompt, dict) and "cache_salt" in prompt:  # (vLLM's place for it)
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise ValueError("cache_salt: given both in the prompt and as an argument, "
                                 "and they differ")
            cache_salt = prompt["cache_salt"]
        check_cache_salt(cache_salt)
        backend = None
        if params.structured_outputs is not None:
            backend = self.validate_structured_outputs(params.structured_outputs)
        text, ids = self.tokenize_prompt(prompt)
        ids = self.truncate(ids, params)
        ids, mm_features = self.process_multimodal(prompt, ids, params)
        self.validate_prompt(ids, sum(f.length for f in mm_features))
        if not params.ignore_eos and self.extra_eos_token_ids:
            params = params.clone(stop_token_ids=[*params.stop_token_ids,
                                                  *self.extra_eos_token_ids])
        reasoning_end = None
        if params.structured_outputs is not None and self.starts_thinking(
                ids, chat_template_kwargs):
            reasoning_end = list(self._reasoning_end_ids)
        arrival_time = time.time() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        reqs = []
        parent_id = f"{request_id}-{os.urandom(4).hex()}" if params.n > 1 else None
        for i in range(params.n):
            # The core's id: the caller's (per sample when n > 1) plus 8 random hex digits, so
            # that ids stay unique in a core that several front ends feed (as vLLM does).
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            rid = f"{rid}-{os.urandom(4).hex()}"
            reqs.append(EngineCoreRequest(
                request_id=rid, prompt_token_ids=ids, sampling_params=params,
                eos_token_id=self.eos_token_id, arrival_time=arrival_time,
                sampling_seed=(base_seed + i) & 0xFFFFFFFF, priority=priority,
                cache_salt=cache_salt, structured_backend=backend, parent_id=parent_id,
                reasoning_end_ids=reasoning_end, lora_request=lora_request,
                mm_features=mm_features or None))
        return text, ids, reqs

    def check_lora(self, lora_request) -> None:
        """A request's lora_request: a LoRARequest, and LoRA enabled (vLLM refuses it so)."""
        if lora_request is None:
            return
        from jaxinfer.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if not self.enable_lora:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled "
                             "(start the engine with enable_lora=True / --enable-lora)")
