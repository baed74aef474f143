"""The messages between the front end and the engine core (msgspec-encoded over ZeroMQ).

The front end owns text (tokenize, chat templates, detokenize, stop strings); the core owns
token ids (schedule, KV, sample). One request type goes in, one output type comes out.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from jaxinfer.lora.request import LoRARequest
from jaxinfer.multimodal.inputs import MultiModalFeature
from jaxinfer.outputs import EngineCoreOutput
from jaxinfer.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence to generate (a child of an n > 1 request is its own EngineCoreRequest)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    sampling_seed: int  # the seed of the request's RNG stream (uint32)
    priority: int = 0
    cache_salt: str | None = None
    structured_backend: str | None = None  # the backend the front end validated it with
    parent_id: str | None = None  # n > 1: the id its samples share (fair admission)
    client_index: int = 0  # which front end (API server) sent it: its outputs go back there
    # Structured outputs behind a reasoning model's thinking: the grammar applies once the
    # output ends with these ids (the reasoning parser's end tag). None: from the first token.
    reasoning_end_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base)
    # Its images (vision-language models): placeholder positions, pixel rows, hashes.
    mm_features: list[MultiModalFeature] | None = None


class RequestType(bytes, enum.Enum):
    """First frame of a front end -> core message."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str] of request ids
    UTILITY = b"\x02"  # payload: (call_id, method name, args): a method of EngineCore
    SHUTDOWN = b"\x03"  # payload: empty; the core finishes its loop and exits


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step (or one utility call) produced, core -> front end."""

    outputs: list[EngineCoreOutput] = []
    stats: dict[str, Any] | None = None  # scheduler / cache stats after the step
    # (call_id, result, error message or None) of a utility call
    utility_output: tuple[int, Any, str | None] | None = None
    # The core failed (startup or a step) and is going away: the error, for the front end.
    engine_error: str | None = None
    ready: dict[str, Any] | None = None  # the startup handshake: facts the front end needs
    engine_index: int = 0  # the data-parallel rank it came from (set by the DP client)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreRequest)


def outputs_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)


class EngineDeadError(RuntimeError):
    """The engine core process is gone (crashed, killed or failed a step); the front end can
    no longer serve. Raised by every client call after the fact."""


_VALUE_ERROR = "engine core utility failed: ValueError: "


def as_value_error(e: RuntimeError) -> Exception:
    """A utility's ValueError that came back from the core's process (or thread) as a
    RuntimeError: the ValueError again (bad input, the engine serves on); others as they
    are."""
    text = str(e)
    return ValueError(text[len(_VALUE_ERROR):]) if text.startswith(_VALUE_ERROR) else e
