"""SamplingParams: vLLM-compatible fields, validated at construction (ValueError names the field)."""

from __future__ import annotations

import dataclasses
import json as _json
from dataclasses import dataclass
from typing import Any, Sequence

from jaxinfer.validation import (FLOAT32_MAX, INT32_MAX, INT64_MAX, INT64_MIN,
                                 MAX_BAD_WORD_CHARS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS,
                                 MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                 FieldError, check_float, check_int, is_int, max_n_sequences)

__all__ = ["SamplingParams", "StructuredOutputsParams", "max_n_sequences"]


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
    # (the `tokenizers` detokenizer joins special tokens without spaces: what vLLM's fast
    # detokenizer gives for either value)
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Keep only the prompt's last k tokens (vLLM's left truncation); -1: max_model_len.
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before
    # sampling (-100 in effect bans it, +100 in effect forces it); applied on the device.
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (a mask row on the device).
    allowed_token_ids: Sequence[int] | None = None
    # vLLM's: words never generated: the front end tokenizes each (as is and after a space)
    # into bad_words_token_ids; a word's last token is masked whenever the output ends with
    # the rest of it (a one-token word always).
    bad_words: Sequence[str] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    # Per-request data for engine extensions (vLLM's extra_args): "kv_transfer_params"
    # (disaggregated prefill/decode) and the keys the engine's logits processors read; the
    # engine refuses other keys by name (validation.check_extra_args).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self):
        """Every field checked against its documented range and the type it is packed into
        (jaxinfer/validation.py); ValueError (a FieldError) naming the field and the limit."""
        def fail(field, msg):
            got = repr(getattr(self, field))
            raise FieldError(field, f"SamplingParams.{field} {msg}, got {got[:200]}")

        own = "SamplingParams."
        max_n = max_n_sequences()
        check_int(own, "n", self.n, 1, max_n, " (JAXINFER_MAX_N_SEQUENCES sets the maximum)")
        check_float(own, "presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float(own, "frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float(own, "repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX,
                    lo_open=True)
        check_float(own, "temperature", self.temperature, 0.0, FLOAT32_MAX)
        check_float(own, "top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int(own, "top_k", self.top_k, -1, INT32_MAX, " (0 or -1 disables it)")
        check_float(own, "min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            check_int(own, "seed", self.seed, INT64_MIN, INT64_MAX)
        if self.max_tokens is not None:
            check_int(own, "max_tokens", self.max_tokens, 1, INT32_MAX, " or None")
        check_int(own, "min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                check_int(own, name, v, 0, MAX_LOGPROBS, " or None")
        t = self.truncate_prompt_tokens
        if t is not None and t != -1:
            check_int(own, "truncate_prompt_tokens", t, 1, INT32_MAX,
                      " (-1: the model's context length) or None")
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            fail("stop", "must be a string or a list of strings")
        stop = list(stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"SamplingParams.stop has {len(stop)} strings, more than "
                                     f"the limit of {MAX_STOP_STRINGS}")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise FieldError("stop", f"SamplingParams.stop[{i}] must be a non-empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise FieldError("stop", f"SamplingParams.stop[{i}] has {len(s)} characters, "
                                         f"more than the limit of {MAX_STOP_STRING_CHARS}")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            fail("stop_token_ids", "must be a list of token ids")
        ids = list(ids or [])
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids", f"SamplingParams.stop_token_ids has {len(ids)} "
                                               f"ids, more than the limit of "
                                               f"{MAX_STOP_TOKEN_IDS}")
        for i, t in enumerate(ids):
            if not is_int(t) or not 0 <= t <= INT32_MAX:
                raise FieldError("stop_token_ids", f"SamplingParams.stop_token_ids[{i}] must be "
                                                   f"an integer in [0, {INT32_MAX}], got {t!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        self._check_token_controls(fail)
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
            if not all(isinstance(k, str) for k in self.extra_args):
                fail("extra_args", "must have string keys")
            ktp = self.extra_args.get("kv_transfer_params")
            if ktp is not None and not isinstance(ktp, dict):
                raise ValueError("SamplingParams.extra_args['kv_transfer_params'] must be a "
                                 f"dict, got {type(ktp).__name__}")
            if ktp is not None and self.n > 1:
                fail("n", "must be 1 with kv_transfer_params (one KV transfer per request)")
        if self.temperature < 1e-5:
            # Greedy: the other sampling knobs do not apply (as in vLLM).
            object.__setattr__(self, "temperature", 0.0)

    def _check_token_controls(self, fail) -> None:
        """logit_bias, allowed_token_ids, bad_words (ranges here; token ids against the
        model's vocabulary in validation.check_for_model)."""
        own = "SamplingParams."
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                fail("logit_bias", "must be a dict of token id -> bias")
            if len(bias) > MAX_LOGIT_BIAS:
                raise FieldError("logit_bias", f"SamplingParams.logit_bias has {len(bias)} "
                                               f"entries, more than the limit of "
                                               f"{MAX_LOGIT_BIAS}")
            out = {}
            for k, v in bias.items():
                if not is_int(k) or not 0 <= k <= INT32_MAX:
                    raise FieldError("logit_bias", f"SamplingParams.logit_bias keys must be "
                                                   f"token ids (integers >= 0), got {k!r:.50}")
                check_float(own, f"logit_bias[{k}]", v, -100.0, 100.0)
                out[int(k)] = float(v)
            object.__setattr__(self, "logit_bias", out or None)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed:
                fail("allowed_token_ids", "must be a non-empty list of token ids or None")
            if len(allowed) > INT32_MAX or not all(is_int(t) and 0 <= t <= INT32_MAX
                                                   for t in allowed):
                fail("allowed_token_ids", "must hold token ids (integers >= 0)")
            object.__setattr__(self, "allowed_token_ids", [int(t) for t in allowed])
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or len(words) > MAX_BAD_WORDS:
                fail("bad_words", f"must be a list of at most {MAX_BAD_WORDS} strings")
            for i, w in enumerate(words):
                if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                    raise FieldError("bad_words", f"SamplingParams.bad_words[{i}] must be a "
                                                  f"non-blank string of at most "
                                                  f"{MAX_BAD_WORD_CHARS} characters")
            object.__setattr__(self, "bad_words", list(words) or None)
        ids = self.bad_words_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or len(ids) > 2 * MAX_BAD_WORDS:
                fail("bad_words", f"bad_words_token_ids must be a list of at most "
                                  f"{2 * MAX_BAD_WORDS} token-id lists")
            for w in ids:
                if not isinstance(w, (list, tuple)) or not 0 < len(w) <= MAX_BAD_WORD_TOKENS \
                        or not all(is_int(t) and 0 <= t <= INT32_MAX for t in w):
                    raise FieldError("bad_words", f"SamplingParams.bad_words_token_ids: each "
                                                  f"word is 1 to {MAX_BAD_WORD_TOKENS} token ids")
            object.__setattr__(self, "bad_words_token_ids", [list(map(int, w)) for w in ids]
                               or None)

    @property
    def uses_token_mask(self) -> bool:
        """allowed_token_ids or bad words: the step masks this request's row."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def validate(self) -> None:
        """Check every field again (ValueError naming it): the engine core does, for requests
        that did not come through a front end's checks."""
        self.__post_init__()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Repetition, frequency or presence penalties: the step keeps per-request token counts
        (so such requests skip prefix-cache hits and take no drafts)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
