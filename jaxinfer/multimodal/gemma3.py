"""The Gemma 3 image processor (HF's Gemma3ImageProcessor, from the checkpoint's
preprocessor_config.json) in numpy and PIL, and the prompt text HF's Gemma3Processor writes
for an image.

Each image: RGB (transparency composited onto white), resized with PIL (bilinear by default)
to the tower's square size, rescaled (1/255) and normalised (mean and std 0.5 by default);
cut into patch_size squares, rows of C x P x P values in raster order (what the tower's
patch embedding reads; models/gemma3.py puts them back into an image). Every image gives
mm_tokens_per_image soft tokens. Pan and scan (extra crops of wide images) is refused by
name: not built."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxinfer.multimodal.qwen2_vl import MAX_ASPECT_RATIO, rescale_normalize, to_rgb

HALF = (0.5, 0.5, 0.5)


@dataclasses.dataclass(frozen=True)
class Gemma3ImageProcessor:
    image_size: int = 896
    patch_size: int = 14
    merge_size: int = 4  # patches a side pooled into one soft token (the projector's)
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF
    rescale_factor: float = 1 / 255
    resample: int = 2  # PIL's BILINEAR
    do_rescale: bool = True
    do_normalize: bool = True

    @staticmethod
    def from_config(d: dict[str, Any], vision) -> "Gemma3ImageProcessor":
        """From a preprocessor_config.json and the model's Gemma3VisionConfig."""
        if d.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config: do_pan_and_scan=true is not supported (pan "
                             "and scan crops are not built)")
        if d.get("do_resize") is False:
            raise ValueError("preprocessor_config: do_resize=false is not supported")
        sig = vision.siglip
        size = d.get("size") or {}
        h, w = (int(size.get(k, sig.image_size)) for k in ("height", "width"))
        if h != sig.image_size or w != sig.image_size:
            raise ValueError(f"preprocessor_config: size {w} x {h} must be the vision tower's "
                             f"image_size {sig.image_size}")
        base = Gemma3ImageProcessor()
        return dataclasses.replace(
            base, image_size=sig.image_size, patch_size=sig.patch_size,
            merge_size=vision.spatial_merge_size,
            **{k: type(getattr(base, k))(d[k]) for k in (
                "rescale_factor", "resample", "do_rescale", "do_normalize") if k in d},
            **{k: tuple(float(x) for x in d[k]) for k in ("image_mean", "image_std")
               if d.get(k) is not None})

    @property
    def side(self) -> int:
        return self.image_size // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        if min(height, width) < 1:
            raise ValueError(f"image of {width} x {height} pixels: both sides must be >= 1")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"image of {width} x {height} pixels: the aspect ratio must be at "
                             f"most {MAX_ASPECT_RATIO}")
        return (self.side // self.merge_size) ** 2

    def __call__(self, images) -> tuple[np.ndarray, np.ndarray]:
        """PIL images -> (pixel rows float32 [N x side^2, C x P x P], grids int64 [N, 3]:
        (1, side, side) each)."""
        rows = []
        s, p = self.image_size, self.patch_size
        for image in images:
            self.num_tokens(image.height, image.width)
            x = rescale_normalize(to_rgb(image).resize((s, s), resample=self.resample), self)
            c, n = x.shape[0], self.side
            rows.append(x.reshape(c, n, p, n, p).transpose(1, 3, 0, 2, 4).reshape(n * n, -1))
        grids = np.asarray([(1, self.side, self.side)] * len(rows), np.int64)
        return np.concatenate(rows), grids


def newline_tokens(model_dir: str) -> dict[int, int]:
    """{k: id of the one token a run of k newlines tokenizes to} with the checkpoint's
    tokenizer.json (Gemma's vocabulary has such runs as single tokens; HF's processor writes
    "\\n\\n" around each image and tokenizes the text, so those runs merge with the
    prompt's own newlines)."""
    import os

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    out = {}
    for k in range(1, 32):
        ids = tok.encode("\n" * k, add_special_tokens=False).ids
        if len(ids) == 1:
            out[k] = ids[0]
    return out
