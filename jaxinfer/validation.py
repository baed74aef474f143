"""The limits every request value is checked against, in one place.

SamplingParams (offline and server), the Processor (the limits that depend on the model: its
vocabulary and context), the engine core (again, for requests that bypass a front end) and the
OpenAI server all use these helpers, so a value is refused the same way wherever it enters,
with an error that names the field and the limit.

Each value is checked against the range of the type it ends up packed into: int32 on the
device (top_k, token ids, token counts), uint32 (sampling seeds, after hashing), int64 in the
msgpack messages between the front end and the engine core (seed, priority), float32 on the
device (temperature, top_p, min_p, penalties). Where vLLM clamps silently (top_k beyond the
vocabulary), jaxinfer refuses instead.
"""

from __future__ import annotations

import math
import os
from typing import Any

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # np.finfo(np.float32).max

MAX_LOGPROBS = 20  # logprobs, prompt_logprobs, top_logprobs (vLLM's default max_logprobs)
# Per request: the engine checks every stop string after every token of every sequence, and
# every stop token id on every token, so these lists are bounded (vLLM has no bound).
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_CACHE_SALT_CHARS = 1024  # a salt is a secret of ~43 characters (256 bits, base64)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request (the step carries them sparse)
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64  # tokens of one tokenized bad word
DEFAULT_MAX_N_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024


def max_n_sequences() -> int:
    """The largest n a request may ask for: JAXINFER_MAX_N_SEQUENCES (default 16384, vLLM's
    VLLM_MAX_N_SEQUENCES default)."""
    return _env_int("JAXINFER_MAX_N_SEQUENCES", DEFAULT_MAX_N_SEQUENCES)


def max_prompts_per_request() -> int:
    """The most prompts one /v1/completions request may carry: JAXINFER_MAX_PROMPTS_PER_REQUEST
    (default 1024; `jaxinfer serve --max-prompts-per-request` sets it)."""
    return _env_int("JAXINFER_MAX_PROMPTS_PER_REQUEST", DEFAULT_MAX_PROMPTS_PER_REQUEST)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


class FieldError(ValueError):
    """A value out of its range; `field` is the request field it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(owner: str, field: str, value: Any, lo: int, hi: int, hint: str = "") -> int:
    """`value` is an integer in [lo, hi]; FieldError "<owner>.<field> must be ..." otherwise."""
    if not is_int(value) or not lo <= value <= hi:
        raise FieldError(field, f"{owner}{field} must be an integer in [{lo}, {hi}]{hint}, "
                                f"got {_show(value)}")
    return value


def check_cache_salt(value: Any) -> str | None:
    """vLLM's cache_salt: None, or a non-empty string (at most MAX_CACHE_SALT_CHARS) that keys
    the request's prefix-cache blocks apart from everyone else's."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
        raise FieldError("cache_salt", f"cache_salt must be a non-empty string of at most "
                                       f"{MAX_CACHE_SALT_CHARS} characters, got {_show(value)}")
    return value


def check_float(owner: str, field: str, value: Any, lo: float, hi: float, *,
                lo_open: bool = False, hi_open: bool = False, hint: str = "") -> float:
    """`value` is a finite number in the interval (bounds open or closed), also representable
    as a float32 (what the device computes with)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and abs(value) <= FLOAT32_MAX)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
        raise FieldError(field, f"{owner}{field} must be a finite number in {interval}{hint}, "
                                f"got {_show(value)}")
    return float(value)


def _num(x: float) -> str:
    return "3.4e38" if x == FLOAT32_MAX else ("-3.4e38" if x == -FLOAT32_MAX else f"{x:g}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_token_ids(field: str, ids: Any, vocab_size: int, owner: str = "") -> list[int]:
    """A list of token ids, each in [0, vocab_size)."""
    if not isinstance(ids, (list, tuple)):
        raise FieldError(field, f"{owner}{field} must be a list of token ids")
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise FieldError(field, f"{owner}{field}[{i}] = {_show(t)} is not a token id of this "
                                    f"model: must be an integer in [0, {vocab_size - 1}]")
    return list(ids)


def check_extra_args(params, known: frozenset[str] = frozenset()) -> None:
    """SamplingParams.extra_args: only keys something in the engine reads (kv_transfer_params,
    and `known`: the keys its logits processors read)."""
    unknown = sorted(set(params.extra_args or ()) - {"kv_transfer_params"} - known)
    if unknown:
        raise FieldError("extra_args", f"SamplingParams.extra_args: unknown key(s) {unknown}; "
                                       f"this engine reads "
                                       f"{sorted({'kv_transfer_params'} | known)}")


def check_for_model(params, *, vocab_size: int, max_model_len: int) -> None:
    """The SamplingParams limits that depend on the model (FieldError naming the field):
    top_k at most the vocabulary, stop token ids in it, truncate_prompt_tokens at most the
    context."""
    if params.top_k > vocab_size:
        raise FieldError("top_k", f"SamplingParams.top_k must be at most the vocabulary size "
                                  f"{vocab_size} (0 or -1: all tokens), got {params.top_k}")
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size, "SamplingParams.")
    if params.logit_bias:
        check_token_ids("logit_bias", list(params.logit_bias), vocab_size, "SamplingParams.")
    if params.allowed_token_ids is not None:
        check_token_ids("allowed_token_ids", params.allowed_token_ids, vocab_size,
                        "SamplingParams.")
    for word in params.bad_words_token_ids or ():
        check_token_ids("bad_words", word, vocab_size, "SamplingParams.")
    t = params.truncate_prompt_tokens
    if t is not None and t > max_model_len:
        raise FieldError("truncate_prompt_tokens", f"SamplingParams.truncate_prompt_tokens "
                         f"({t}) is greater than max_model_len ({max_model_len}); select a "
                         "smaller truncation size")


def check_core_request(req, *, vocab_size: int, max_model_len: int,
                       extra_args_keys: frozenset[str] = frozenset()) -> None:
    """What the engine core checks of an EngineCoreRequest before its scheduler sees it: the
    front end checked all of it already, but a request that bypassed a front end (or a bug in
    one) must fail alone instead of failing a step. ValueError naming the field."""
    import numpy as np

    params = req.sampling_params
    params.validate()
    check_for_model(params, vocab_size=vocab_size, max_model_len=max_model_len)
    check_extra_args(params, extra_args_keys)
    ids = req.prompt_token_ids
    if not isinstance(ids, (list, tuple)) or not ids:
        raise FieldError("prompt_token_ids", "prompt_token_ids must be a non-empty list")
    if len(ids) > max_model_len:
        raise FieldError("prompt_token_ids", f"the prompt has {len(ids)} tokens, more than "
                                             f"max_model_len={max_model_len}")
    try:
        arr = np.asarray(ids, dtype=np.int64)
        bad = arr.ndim != 1 or int(arr.min()) < 0 or int(arr.max()) >= vocab_size
    except (OverflowError, TypeError, ValueError):
        bad = True
    if bad:
        check_token_ids("prompt_token_ids", ids, vocab_size)  # names the first bad one
        raise FieldError("prompt_token_ids", "prompt_token_ids must be a list of token ids")
    check_int("", "sampling_seed", req.sampling_seed, 0, 2**32 - 1)
    check_int("", "priority", req.priority, INT64_MIN, INT64_MAX)
    if req.eos_token_id is not None:
        check_int("", "eos_token_id", req.eos_token_id, 0, vocab_size - 1)
    end = req.reasoning_end_ids
    if end is not None and (not isinstance(end, (list, tuple)) or not 0 < len(end) <= 64):
        raise FieldError("reasoning_end_ids", "reasoning_end_ids must be a list of 1 to 64 "
                                              "token ids")
