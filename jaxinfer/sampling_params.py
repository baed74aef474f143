"""SamplingParams: vLLM-compatible fields, validated at construction (ValueError names the field)."""

from __future__ import annotations

import dataclasses
import json as _json
import os
from dataclasses import dataclass
from typing import Any, Sequence

_MAX_LOGPROBS = 20


def max_n_sequences() -> int:
    """The largest n a request may ask for: JAXINFER_MAX_N_SEQUENCES (default 16384, vLLM's
    VLLM_MAX_N_SEQUENCES default)."""
    return int(os.environ.get("JAXINFER_MAX_N_SEQUENCES", "16384"))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's field names): exactly one of `json` (a JSON schema,
    dict or string), `regex`, `choice` (the output is one of the strings), `grammar` (Lark, or
    GBNF/EBNF as llama.cpp writes it), `json_object=True` (any JSON object) or `structural_tag`.
    The rest tune JSON output: `disable_any_whitespace` (compact JSON), `whitespace_pattern`
    (a regex for the whitespace between tokens), `disable_additional_properties` (objects
    whose schema lists properties get no others unless it says so)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"structured_outputs: {msg}")

        kinds = [k for k in _CONSTRAINTS if getattr(self, k) is not None]
        if len(kinds) != 1:
            fail(f"exactly one of {', '.join(_CONSTRAINTS)} must be set, got "
                 f"{kinds or 'none'}")
        if isinstance(self.json, str):
            try:
                obj = _json.loads(self.json)
            except ValueError as e:
                fail(f"json is not valid JSON: {e}")
            object.__setattr__(self, "json", obj)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            fail(f"json must be a JSON schema (an object), got {type(self.json).__name__}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                fail("choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and self.json_object is not True:
            fail("json_object must be true when set")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                fail(f"{name} must be a string")
        if isinstance(self.grammar, str) and not self.grammar.strip():
            fail("grammar must not be empty")
        if isinstance(self.structural_tag, str) and not self.structural_tag.strip():
            fail("structural_tag must not be empty")
        if kinds[0] not in ("json", "json_object", "structural_tag"):
            for name in ("disable_any_whitespace", "disable_additional_properties"):
                if getattr(self, name):
                    fail(f"{name} applies to JSON constraints only, not to {kinds[0]}")
            if self.whitespace_pattern is not None:
                fail(f"whitespace_pattern applies to JSON constraints only, not to {kinds[0]}")

    @property
    def kind(self) -> str:
        return next(k for k in _CONSTRAINTS if getattr(self, k) is not None)

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    def key(self) -> str:
        """A string that identifies the compiled grammar (the compile cache's key)."""
        return _json.dumps([self.kind, self.spec, self.disable_any_whitespace,
                            self.disable_additional_properties, self.whitespace_pattern],
                           sort_keys=True)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output. Field names and defaults follow vLLM.

    temperature == 0 means greedy. top_k 0 or -1 means all tokens. `stop` strings end the output
    (not included unless include_stop_str_in_output); `stop_token_ids` end it on those tokens.
    `max_tokens=None` means "until max_model_len".
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Per-request data for engine extensions (vLLM's extra_args); jaxinfer reads only
    # "kv_transfer_params" (disaggregated prefill/decode), other keys are refused by name.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self):
        def fail(field, msg):
            raise ValueError(f"SamplingParams.{field} {msg}, got {getattr(self, field)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        max_n = max_n_sequences()
        if self.n > max_n:
            fail("n", f"must be at most {max_n} (raise JAXINFER_MAX_N_SEQUENCES to allow more)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "must be > 0")
        if not self.temperature >= 0.0:
            fail("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= _MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {_MAX_LOGPROBS}] or None")
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        stop = list(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            fail("stop", "must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(i, int) or i < 0 for i in ids):
            fail("stop_token_ids", "must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)
        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = sorted(set(so) - {f.name for f in dataclasses.fields(
                StructuredOutputsParams)})
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs: unknown field(s) {unknown}")
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            fail("structured_outputs", "must be StructuredOutputsParams or None")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                fail("extra_args", "must be a dict or None")
            unknown = sorted(set(self.extra_args) - {"kv_transfer_params"})
            if unknown:
                raise ValueError(f"SamplingParams.extra_args: unknown key(s) {unknown}; "
                                 "jaxinfer reads only 'kv_transfer_params'")
            ktp = self.extra_args.get("kv_transfer_params")
            if ktp is not None and not isinstance(ktp, dict):
                raise ValueError("SamplingParams.extra_args['kv_transfer_params'] must be a "
                                 f"dict, got {type(ktp).__name__}")
            if ktp is not None and self.n > 1:
                fail("n", "must be 1 with kv_transfer_params (one KV transfer per request)")
        if self.temperature < 1e-5:
            # Greedy: the other sampling knobs do not apply (as in vLLM).
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
