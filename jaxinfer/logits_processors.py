"""Custom logits processors (vLLM V1's extension point, for a compiled step).

vLLM's processors keep batch state on the GPU and change the logits in place each step. Here
the step is one compiled program, so a processor is split in two:
- on the host, `row(params)` turns one request's SamplingParams (typically a key of its
  `extra_args`) into a fixed-shape row of numbers, or None when the processor leaves that
  request alone; the runner keeps each request's row while it runs;
- on the device, `apply(logits, rows, active)` is traced into the step: a pure function of the
  batch's logits [R, V] (float32), the rows [R, *row_shape] and which rows use it [R] (bool).
  It runs in batch, after logit_bias and the token masks, before penalties and sampling.

A step compiles the processors in only when one of its rows uses one. Engines take them as
`LLM(..., logits_processors=[MyProcessor, "pkg.module:Other"])` (classes or import paths;
`--logits-processors` on the command line); each class declares the `extra_args` keys it
reads, so that a request with a key no processor reads is refused by name.

An example, run by the tests: tests/engine/logits_processor_examples.py (docs/logits_processors.md
shows it with its use).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np


class LogitsProcessor:
    """Base class of a custom logits processor (see the module's text)."""

    row_shape: tuple[int, ...] = ()  # one request's row of parameters
    row_dtype: str = "float32"
    extra_args_keys: tuple[str, ...] = ()  # the SamplingParams.extra_args keys it reads

    def __init__(self, config: Any = None) -> None:
        """config: the engine's ResolvedConfig (model and engine settings)."""
        self.config = config

    @classmethod
    def validate_params(cls, params) -> None:
        """Refuse a request's parameters this processor cannot use: ValueError naming the
        field (the front end calls it before the request reaches the engine core)."""

    def row(self, params) -> np.ndarray | None:
        """This request's row (row_shape, row_dtype), or None: not applied to it."""
        return None

    def apply(self, logits, rows, active):
        """On the device, traced into the step: logits [R, V] float32, rows [R, *row_shape],
        active bool [R] -> logits [R, V]. Rows that are not active must come back as they
        came (padding rows are never active)."""
        raise NotImplementedError

    def is_argmax_invariant(self) -> bool:
        """vLLM's flag: True if the processor never changes a greedy choice."""
        return False


def processor_path(spec) -> str:
    """'module:QualName' of a processor class, or of an import path given as
    'module:QualName' or 'module.QualName' (vLLM's form); ValueError naming the field."""
    if isinstance(spec, type):
        path = f"{spec.__module__}:{spec.__qualname__}"
    elif isinstance(spec, str) and spec:
        path = spec if ":" in spec else ":".join(spec.rsplit(".", 1))
    else:
        raise ValueError(f"logits_processors: expected a LogitsProcessor class or an import "
                         f"path, got {spec!r}")
    load_processor(path)
    return path


def load_processor(path: str) -> type[LogitsProcessor]:
    module, _, name = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"logits_processors: cannot import {path!r} ({e})") from None
    if not (isinstance(obj, type) and issubclass(obj, LogitsProcessor)):
        raise ValueError(f"logits_processors: {path!r} is not a subclass of "
                         "jaxinfer.logits_processors.LogitsProcessor")
    return obj
