"""The one table of dtype names: what a name in a config, a checkpoint header or a CLI flag
means as an array dtype (numpy / ml_dtypes types, which jax takes as they are)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),
}
# Weight dtypes a model can be held in (`dtype`; "auto": the checkpoint's).
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def dtype(name: str) -> np.dtype:
    """The array dtype called `name` (ValueError naming the known ones otherwise)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})") from None
