"""Rotary position scaling as an HF config.json describes it."""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in HF ``rope_scaling`` / ``rope_parameters`` (types: ROPE_TYPES)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3, yarn
    # yarn (gpt-oss, DeepSeek-V3, Qwen long context): the ramp between interpolated and
    # extrapolated frequencies, and the factor on cos / sin (attention_factor, or from mscale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @staticmethod
    def from_hf(d: dict | None) -> "RopeScaling":
        if not d:
            return RopeScaling()
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "mrope":  # (Qwen2-VL's name; its sections: ModelConfig.mrope_section)
            rope_type = "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type={rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES)})"
            )
        if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in d:
            raise ValueError(f"rope_scaling {rope_type} needs original_max_position_embeddings")
        if rope_type == "yarn" and not d.get("factor"):
            raise ValueError("rope_scaling yarn needs a factor")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope partial_rotary_factor={d['partial_rotary_factor']} is not "
                             "supported (rotary over the whole head only)")

        def opt(key):
            return None if d.get(key) is None else float(d[key])

        return RopeScaling(
            rope_type=rope_type,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            truncate=bool(d.get("truncate", True)),
            attention_factor=opt("attention_factor"),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
        )
