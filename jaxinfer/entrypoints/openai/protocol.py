"""Pydantic models of the OpenAI API subset jaxinfer serves, and their SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SkipValidation, model_validator

from jaxinfer.entrypoints.openai.tools import (ToolError, named_tool, tool_choice_schema,
                                               validate_tools)
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams
from jaxinfer.validation import (FLOAT32_MAX, INT32_MAX, INT64_MAX, INT64_MIN, MAX_BAD_WORDS,
                                 MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                 MAX_STOP_STRING_CHARS,
                                 MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOOLS)

# The documented ranges (what /openapi.json shows, so generated requests probe the edges):
# the range of the type each value is packed into, or its own narrower range. Limits that
# depend on the model or the server (vocabulary, context, n) are checked after these.
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


def _float(lo: float | None = None, hi: float | None = None, *, gt: float | None = None):
    return Field(None, ge=lo, le=hi, gt=gt, allow_inf_nan=False)

# Fields OpenAI clients send routinely that change nothing about the generated text: accepted
# and ignored. Any other field the models below do not declare is refused with a 400 naming it.
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key",
                  "safety_identifier")


class UnsupportedField(ValueError):
    """A request field jaxinfer cannot honour (yet); the server answers 400 naming it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (not supported)

    @model_validator(mode="after")
    def _refuse_continuous_usage(self):
        if self.continuous_usage_stats:
            raise UnsupportedField("stream_options.continuous_usage_stats",
                                   "stream_options.continuous_usage_stats is not supported")
        return self


class _Common(BaseModel):
    # strict: a value of the wrong JSON type is a 400 ("0.5" is not a temperature), not coerced.
    model_config = ConfigDict(extra="allow", strict=True)
    _structured: Any = PrivateAttr(default=None)
    _logit_bias: dict = PrivateAttr(default_factory=dict)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = _float(0.0, FLOAT32_MAX)
    top_p: float | None = _float(hi=1.0, gt=0.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = _float(0.0, 1.0)
    n: int = Field(1, ge=1, le=INT32_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None \
        = None
    stop_token_ids: Annotated[list[Int32], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Int64 | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = _float(hi=FLOAT32_MAX, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    # vLLM's. The `tokenizers` detokenizer joins special tokens without spaces, which is what
    # vLLM's fast detokenizer gives for either value (its slow path alone differs).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: lower runs first under --scheduling-policy priority (must be 0 otherwise).
    priority: Int64 = 0
    # vLLM's: salts the request's prefix-cache blocks, so that only requests with the same
    # salt share them (a secret per user or tenant).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: keep only the prompt's last k tokens (-1: the model's context length).
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured outputs: OpenAI's response_format (text, json_object, json_schema; vLLM's
    # structural_tag), vLLM's structured_outputs, and vLLM's older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI's: token id (as a string) -> bias, clamped to [-100, 100] as vLLM does.
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's: only these tokens may be sampled; words never to generate.
    allowed_token_ids: Annotated[list[Int32], Field(min_length=1)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    # Accepted only at their no-op values (None, equal to n): a request that needs them gets a
    # 400 naming the field instead of output that ignores them.
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)
    # Disaggregated prefill/decode (vLLM's field): {"do_remote_decode": true} asks a prefill
    # instance to keep the prompt's KV for a decode instance; the params a prefill instance
    # answers with tell the decode instance where to pull it from.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the prompt's logprobs (top k at each position) in the response; not streamed.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: logprob tokens as "token_id:<id>" (for tokens that are not valid text alone)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: parameters for custom extensions (the engine's logits processors), passed as
    # SamplingParams.extra_args; a key no processor reads is a 400 naming it.
    vllm_xargs: Annotated[dict[str, str | int | float | list[str | int | float]],
                          Field(max_length=64)] | None = None

    @model_validator(mode="after")
    def _refuse_what_is_not_honoured(self):
        extra = sorted(set(self.model_extra or {}) - set(IGNORED_FIELDS))
        if extra:
            raise UnsupportedField(extra[0], f"{extra[0]}: unsupported request field (jaxinfer "
                                   f"ignores only {', '.join(IGNORED_FIELDS)})")
        if self.guided_decoding_backend is not None:
            raise UnsupportedField("guided_decoding_backend", "guided_decoding_backend: the "
                                   "backend is chosen per server (--structured-outputs-config "
                                   "'{\"backend\": ...}')")
        self._structured = self._structured_outputs()
        if self.logit_bias:  # (ids checked by SamplingParams and against the vocabulary;
            # NaN never gets here: the body parser refuses it for every field)
            try:
                self._logit_bias = {int(k): min(100.0, max(-100.0, float(v)))
                                    for k, v in self.logit_bias.items()}
            except ValueError:
                raise UnsupportedField("logit_bias", "logit_bias keys must be token ids "
                                       "(integers as strings)") from None
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedField("prompt_logprobs", "`prompt_logprobs` are not available when "
                                   "`stream=True`.")
        if "kv_transfer_params" in (self.vllm_xargs or {}):
            raise UnsupportedField("vllm_xargs", "vllm_xargs.kv_transfer_params: use the "
                                   "request's kv_transfer_params field")
        if self.kv_transfer_params is not None and self.n != 1:
            raise UnsupportedField("kv_transfer_params", "kv_transfer_params needs n=1 (one "
                                   "KV transfer per request)")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField("best_of", f"best_of={self.best_of} is not supported "
                                   "(as in vLLM V1): leave it unset or equal to n")
        return self

    def _structured_outputs(self) -> tuple[str, dict] | None:
        """(the request field it came from, StructuredOutputsParams fields) or None."""
        found = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                    raise UnsupportedField("response_format", "response_format.json_schema."
                                           "schema is required (a JSON schema object)")
                found.append(("response_format", {"json": js["schema"]}))
            elif kind == "structural_tag":
                import json

                found.append(("response_format", {"structural_tag": json.dumps(rf)}))
            elif kind != "text":
                raise UnsupportedField("response_format", f"response_format type {kind!r} is "
                                       "not supported: use text, json_object, json_schema or "
                                       "structural_tag")
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if len(found) > 1:
            names = [f for f, _ in found]
            raise UnsupportedField(names[1], f"only one structured-output constraint per "
                                   f"request, got {', '.join(names)}")
        if self.guided_whitespace_pattern is not None:
            if not found:
                raise UnsupportedField("guided_whitespace_pattern", "guided_whitespace_pattern "
                                       "needs a JSON constraint")
            found[0][1].setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        if not found:
            return None
        field, spec = found[0]
        try:
            StructuredOutputsParams(**spec)
        except (TypeError, ValueError) as e:
            raise UnsupportedField(field, f"{field}: {e}") from None
        return field, spec

    @property
    def structured_field(self) -> str | None:
        """The request field the structured-output constraint came from (for error params)."""
        return self._structured[0] if self._structured else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: dict) -> SamplingParams:
        """defaults: the server's default sampling parameters (the model's generation config)
        for the fields this request leaves unset; its max_tokens caps the request's (vLLM's
        rule: the smallest of the two)."""
        def value(name, builtin):
            own = getattr(self, name)
            return own if own is not None else defaults.get(name, builtin)

        if defaults.get("max_tokens") is not None:
            max_tokens = defaults["max_tokens"] if max_tokens is None \
                else min(max_tokens, defaults["max_tokens"])
        return SamplingParams(
            n=self.n, temperature=value("temperature", 1.0), top_p=value("top_p", 1.0),
            top_k=value("top_k", 0), min_p=value("min_p", 0.0), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=value("repetition_penalty", 1.0),
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias=self._logit_bias or None, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=StructuredOutputsParams(**self._structured[1])
            if self._structured else None,
            extra_args=self._extra_args())

    def _extra_args(self) -> dict | None:
        extra = dict(self.vllm_xargs or {})
        if self.kv_transfer_params is not None:
            extra["kv_transfer_params"] = self.kv_transfer_params
        return extra or None


class CompletionRequest(_Common):
    # Checked by body.check_prompt before validation (fast loops instead of a union over
    # a million ids); the annotation documents it.
    prompt: SkipValidation[str | list[str] | list[int] | list[list[int]]]
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_fields(self):
        if self.suffix:
            raise UnsupportedField("suffix", "suffix (insertion) is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedField("max_tokens", "max_tokens=0 needs echo=true (prompt "
                                   "logprobs only)")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens=0 (lm-eval's loglikelihood): score the prompt, generate
        nothing."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        # max_tokens=0 (echo): one token is generated and dropped, as vLLM does.
        params = self._sampling_params(1 if self.prompt_only else self.max_tokens,
                                       self.logprobs, defaults or {})
        if self.echo and self.logprobs is not None:
            params = params.clone(prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        return params


# Message fields OpenAI clients echo back from a response (assistant messages) that carry
# nothing for the prompt: accepted while empty.
_EMPTY_MESSAGE_FIELDS = ("refusal", "audio", "function_call", "annotations", "reasoning_content",
                         "reasoning")


# Template variables the server sets itself: a request's chat_template_kwargs may not.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token",
                               "eos_token", "chat_template", "tokenize")


def check_chat_template_kwargs(kwargs: dict | None, field: str = "chat_template_kwargs"):
    """Template variables: names a template can use, none the server sets itself."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_VARIABLES:
            hint = " (use the request's own field)" if key in (
                "tools", "chat_template", "add_generation_prompt") else ""
            raise UnsupportedField(field, f"{field}: {key!r} is set by the server{hint}")
        if not key.isidentifier():
            raise UnsupportedField(field, f"{field}: {key!r} is not a template variable name")


def check_image_part(part: dict, where: str) -> None:
    """{"type": "image_url", "image_url": {"url": str, "detail": "auto"}} (OpenAI's shape;
    the url is loaded by the route)."""
    extra = set(part) - {"type", "image_url"}
    if extra:
        raise UnsupportedField(where, f"{where}: unsupported key(s) {sorted(extra)} in an "
                               "image_url part")
    img = part.get("image_url")
    if not isinstance(img, dict) or not isinstance(img.get("url"), str) or not img["url"]:
        raise UnsupportedField(where, f"{where}: an image_url part is "
                               "{\"type\": \"image_url\", \"image_url\": {\"url\": <string>}}")
    if set(img) - {"url", "detail"}:
        raise UnsupportedField(where, f"{where}.image_url: unsupported key(s) "
                               f"{sorted(set(img) - {'url', 'detail'})}")
    if img.get("detail", "auto") != "auto":
        raise UnsupportedField(f"{where}.image_url.detail", f"{where}.image_url.detail="
                               f"{img['detail']!r} is not supported (auto: the model's own "
                               "resolution limits apply)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    # an assistant's earlier thinking, passed to the template (vLLM accepts both names)
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _refuse_unknown(self):
        for key, value in (self.model_extra or {}).items():
            if key not in _EMPTY_MESSAGE_FIELDS or value:
                raise UnsupportedField(f"messages.{key}", f"messages.{key}: unsupported message "
                                       "field" + (" (only accepted empty)"
                                                  if key in _EMPTY_MESSAGE_FIELDS else ""))
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's: the last message is left open for the model to continue (no generation prompt)
    continue_final_message: bool = False
    # vLLM's: documents for retrieval-augmented templates ({"title": ..., "text": ...} each)
    documents: Annotated[list[dict[str, str]], Field(max_length=MAX_TOOLS)] | None = None
    # vLLM's: with a --reasoning-parser, whether the thinking goes out (reasoning_content)
    include_reasoning: bool = True
    chat_template: str | None = None
    # vLLM's: more variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    _tools: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _chat_fields(self):
        check_chat_template_kwargs(self.chat_template_kwargs)
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedField("continue_final_message", "Cannot set both "
                                   "`continue_final_message` and `add_generation_prompt` to "
                                   "True.")
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", "when using `top_logprobs`, `logprobs` must "
                                   "be set to true")
        for i, m in enumerate(self.messages):
            if not isinstance(m.content, list):
                continue
            for j, part in enumerate(m.content):
                kind = part.get("type")
                where = f"messages[{i}].content[{j}]"
                if kind == "image_url" and m.role == "user":
                    check_image_part(part, where)
                    continue
                if kind != "text":
                    what = (f"a {kind!r} content part" if isinstance(kind, str)
                            else "a content part without a type")
                    raise UnsupportedField(where, f"{where}: {what} cannot be used here "
                                           "(content parts of type 'text', and 'image_url' in "
                                           "user messages)")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise UnsupportedField(where, f"{where}: a text part is "
                                           "{\"type\": \"text\", \"text\": <string>}")
        if self.functions:
            raise UnsupportedField("functions", "functions (deprecated by OpenAI) is not "
                                   "supported: use tools")
        if self.function_call not in (None, "none", "auto"):
            raise UnsupportedField("function_call", "function_call (deprecated by OpenAI) is "
                                   "not supported: use tool_choice")
        try:
            self._tools = validate_tools(self.tools)
            choice = self.tool_choice
            if choice is None:
                choice = self.tool_choice = "auto" if self._tools else "none"
            if isinstance(choice, str) and choice not in ("none", "auto", "required"):
                raise ToolError("tool_choice", f"tool_choice={choice!r}: use 'none', 'auto', "
                                               "'required' or a named function")
            if choice != "none" and not self._tools:
                raise ToolError("tool_choice", "tool_choice needs tools")
            schema = tool_choice_schema(choice, self._tools, self.parallel_tool_calls)
        except ToolError as e:
            raise UnsupportedField(e.field, str(e)) from None
        if schema is not None:
            if self._structured:
                raise UnsupportedField(self._structured[0], f"{self._structured[0]} cannot be "
                                       f"combined with tool_choice={choice!r}")
            self._structured = ("tool_choice", {"json": schema})
        return self

    @property
    def forced_tool_choice(self) -> bool:
        """The output is the tool call(s): a named function or "required"."""
        return self.tool_choice == "required" or named_tool(self.tool_choice) is not None

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        n_lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, n_lp, defaults or {})

    @property
    def image_urls(self) -> list[tuple[str, str]]:
        """(where, url) of every image_url part, in order."""
        return [(f"messages[{i}].content[{j}]", p["image_url"]["url"])
                for i, m in enumerate(self.messages) if isinstance(m.content, list)
                for j, p in enumerate(m.content) if p.get("type") == "image_url"]

    def conversation(self, content_format: str = "string",
                     image_text: str = "") -> list[dict[str, Any]]:
        """The messages as the chat template gets them; content_format "openai": a message's
        content as a list of {"type": "text", "text": ...} and {"type": "image"} parts (else
        one string, each image written as `image_text`, the model's placeholder)."""
        conv = []
        for m in self.messages:
            content = m.content
            if content_format == "openai":
                content = ([{"type": "text", "text": content}] if isinstance(content, str)
                           else [{"type": "image"} if p.get("type") == "image_url" else dict(p)
                                 for p in content or []])
            elif isinstance(content, list):  # OpenAI content parts (checked above)
                content = "".join(image_text if p.get("type") == "image_url" else p["text"]
                                  for p in content)
            msg = {"role": m.role, "content": content or ("" if content_format != "openai"
                                                          else [])}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if thought is not None:
                msg["reasoning_content"] = msg["reasoning"] = thought
            conv.append(msg)
        return conv


Role = Literal["system", "user", "assistant", "tool"]
