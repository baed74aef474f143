"""A vision encoder's config (the `vision_config` of a vision-language checkpoint)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixels per patch row: C x T x P x P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "VisionConfig":
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported (silu)")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type={rope['rope_type']!r} is not supported "
                             "(axial)")
        cfg = VisionConfig(
            depth=int(d["depth"]), hidden_size=int(d["hidden_size"]),
            num_heads=int(d["num_heads"]), intermediate_size=int(d["intermediate_size"]),
            out_hidden_size=int(d["out_hidden_size"]),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            window_size=int(d.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", ())),
            in_channels=int(d.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))))
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ValueError(f"vision_config: hidden_size={cfg.hidden_size} over num_heads="
                             f"{cfg.num_heads} must give a head size divisible by 4")
        unit = cfg.patch_size * cfg.spatial_merge_size
        if cfg.window_size % unit:
            raise ValueError(f"vision_config.window_size={cfg.window_size} must be a multiple "
                             f"of patch_size x spatial_merge_size = {unit}")
        return cfg


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    """A SigLIP vision encoder (Gemma 3's `vision_config`): image_size^2 pixels in
    (image_size / patch_size)^2 patches, learned position embeddings, pre-LayerNorm blocks
    with biased q/k/v/out projections and a gelu-tanh MLP, a final LayerNorm."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int = 896
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "SiglipVisionConfig":
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported "
                             "(gelu_pytorch_tanh)")
        if d.get("vision_use_head"):
            raise ValueError("vision_config.vision_use_head (an attention-pooling head) is "
                             "not supported")
        cfg = SiglipVisionConfig(
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            image_size=int(d.get("image_size", 896)), patch_size=int(d.get("patch_size", 14)),
            num_channels=int(d.get("num_channels", 3)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-6)))
        if cfg.image_size % cfg.patch_size or cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"vision_config: image_size={cfg.image_size} must be a multiple "
                             f"of patch_size={cfg.patch_size} and hidden_size a multiple of "
                             "num_attention_heads")
        return cfg


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    """Gemma 3's image path as the engine sees it: the SigLIP tower (`siglip`), its patches
    average-pooled to mm_tokens_per_image soft tokens, each image written in the prompt as
    <start_of_image> (boi), the soft tokens (image_token_id), <end_of_image> (eoi)."""

    siglip: SiglipVisionConfig
    mm_tokens_per_image: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def patch_dim(self) -> int:
        """Pixels per patch row: C x P x P."""
        return self.siglip.num_channels * self.siglip.patch_size ** 2

    @property
    def spatial_merge_size(self) -> int:
        """Patches a side pooled into one soft token."""
        return self.siglip.patches_per_side // self.pooled_side

    @property
    def grid(self) -> tuple[int, int, int]:
        """Every image's patch grid (one size: the tower's square input)."""
        side = self.siglip.patches_per_side
        return 1, side, side

    @property
    def pooled_side(self) -> int:
        return int(round(self.mm_tokens_per_image ** 0.5))

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "Gemma3VisionConfig":
        """From a Gemma3ForConditionalGeneration config (its top-level keys and vision_config)."""
        siglip = SiglipVisionConfig.from_hf_dict(d["vision_config"])
        n = int(d.get("mm_tokens_per_image", 256))
        side = int(round(n ** 0.5))
        if side * side != n or siglip.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image={n} must be a square whose side divides the "
                             f"{siglip.patches_per_side} patches a side")
        return Gemma3VisionConfig(
            siglip=siglip, mm_tokens_per_image=n,
            boi_token_id=int(d.get("boi_token_id", d.get("boi_token_index", 255999))),
            eoi_token_id=int(d.get("eoi_token_id", d.get("eoi_token_index", 256000))))
