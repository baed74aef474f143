"""Rotary position scaling as an HF config.json describes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in HF ``rope_scaling`` (types: none/default, linear, llama3)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    @staticmethod
    def from_hf(d: dict | None) -> "RopeScaling":
        if not d:
            return RopeScaling()
        if "original_max_position_embeddings" not in d and d.get("rope_type") == "llama3":
            raise ValueError("rope_scaling llama3 needs original_max_position_embeddings")
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"rope_scaling.rope_type={rope_type!r} is not supported "
                "(supported: default, linear, llama3)"
            )
        return RopeScaling(
            rope_type=rope_type,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )
