"""The Qwen2-VL / Qwen2.5-VL image processor (HF's Qwen2VLImageProcessor, from the checkpoint's
preprocessor_config.json) in numpy and PIL.

Each image: RGB (transparency composited onto white); resized with PIL (bicubic by default)
to the `smart_resize` size, both sides multiples of patch_size x merge_size, the pixel count
within [min_pixels, max_pixels], the aspect ratio kept as far as that allows (and at most
200); rescaled (1/255) and normalised
(the CLIP mean and std by default); cut into patch_size squares, each repeated over
temporal_patch_size frames, as rows of C x T x P x P values in merge_size x merge_size groups
(the vision tower's input order). The grid (1, h / P, w / P) gives the image's
h * w / (P^2 merge^2) placeholder tokens in the prompt."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The processor's target size (HF's formula)."""
    if min(height, width) < 1:
        raise ValueError(f"image of {width} x {height} pixels: both sides must be >= 1")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {width} x {height} pixels: the aspect ratio must be at "
                         f"most {MAX_ASPECT_RATIO}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image):
    """A PIL image as RGB, any transparency composited onto white (as HF and vLLM do)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def rescale_normalize(image, proc) -> np.ndarray:
    """A resized RGB PIL image -> float32 [C, H, W]: times proc.rescale_factor (in float64,
    as HF), then (x - mean) / std in float32, each if the processor's config says so."""
    x = np.asarray(image).transpose(2, 0, 1)  # [C, H, W]
    if proc.do_rescale:
        x = (x.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    if proc.do_normalize:
        mean = np.asarray(proc.image_mean, np.float32)[:, None, None]
        std = np.asarray(proc.image_std, np.float32)[:, None, None]
        x = (x.astype(np.float32) - mean) / std
    return np.asarray(x, np.float32)


@dataclasses.dataclass(frozen=True)
class Qwen2VLImageProcessor:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @staticmethod
    def from_config(d: dict[str, Any]) -> "Qwen2VLImageProcessor":
        """From a preprocessor_config.json (min_pixels / max_pixels, or size's shortest_edge /
        longest_edge, as HF reads them)."""
        size = d.get("size") or {}
        base = Qwen2VLImageProcessor()
        out = dataclasses.replace(
            base,
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge") or base.min_pixels),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge") or base.max_pixels),
            **{k: type(getattr(base, k))(d[k]) for k in (
                "patch_size", "temporal_patch_size", "merge_size", "rescale_factor",
                "resample", "do_resize", "do_rescale", "do_normalize") if k in d},
            **{k: tuple(float(x) for x in d[k]) for k in ("image_mean", "image_std")
               if d.get(k) is not None})
        if out.min_pixels > out.max_pixels:
            raise ValueError(f"preprocessor_config: min_pixels={out.min_pixels} > "
                             f"max_pixels={out.max_pixels}")
        return out

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patches of an image of height x width pixels."""
        if self.do_resize:
            height, width = smart_resize(height, width, self.factor, self.min_pixels,
                                         self.max_pixels)
        elif height % self.factor or width % self.factor:
            raise ValueError(f"image of {width} x {height} pixels: without resizing both sides "
                             f"must be multiples of {self.factor}")
        return 1, height // self.patch_size, width // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of height x width pixels."""
        t, h, w = self.grid(height, width)
        return t * h * w // self.merge_size ** 2

    def __call__(self, images) -> tuple[np.ndarray, np.ndarray]:
        """PIL images -> (pixel_values float32 [N, C x T x P x P], image_grid_thw int64
        [images, 3])."""
        rows, grids = [], []
        for image in images:
            t, gh, gw = self.grid(image.height, image.width)
            image = to_rgb(image)
            if self.do_resize:
                image = image.resize((gw * self.patch_size, gh * self.patch_size),
                                     resample=self.resample)
            rows.append(self._patches(rescale_normalize(image, self), gh, gw))
            grids.append((t, gh, gw))
        return np.concatenate(rows), np.asarray(grids, np.int64)

    def _patches(self, x: np.ndarray, gh: int, gw: int) -> np.ndarray:
        c, p, m = x.shape[0], self.patch_size, self.merge_size
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None],
                            (*x.shape[:5], self.temporal_patch_size, p, p))
        return np.ascontiguousarray(x).reshape(gh * gw, c * self.temporal_patch_size * p * p)
