"""Two custom logits processors for the tests (importable by the engine-core process)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.logits_processors import LogitsProcessor


class BanToken(LogitsProcessor):
    """extra_args={"ban_token": id}: that token is never sampled (the docs' example)."""

    extra_args_keys = ("ban_token",)
    row_shape, row_dtype = (), "int32"

    @classmethod
    def validate_params(cls, params):
        tok = (params.extra_args or {}).get("ban_token")
        if tok is not None and not (isinstance(tok, int) and tok >= 0):
            raise ValueError("extra_args.ban_token must be a token id")

    def row(self, params):
        tok = (params.extra_args or {}).get("ban_token")
        return None if tok is None else np.int32(tok)

    def apply(self, logits, rows, active):
        hit = (jnp.arange(logits.shape[1])[None, :] == rows[:, None]) & active[:, None]
        return jnp.where(hit, -jnp.inf, logits)


class Boost(LogitsProcessor):
    """extra_args={"boost": [token, amount]}: amount added to that token's logit."""

    extra_args_keys = ("boost",)
    row_shape, row_dtype = (2,), "float32"

    def row(self, params):
        b = (params.extra_args or {}).get("boost")
        return None if b is None else np.asarray(b, np.float32)

    def apply(self, logits, rows, active):
        tok = rows[:, 0].astype(jnp.int32)
        amount = jnp.where(active, rows[:, 1], 0.0)
        return logits.at[jnp.arange(logits.shape[0]), tok].add(amount)
