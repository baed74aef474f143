"""Images as request inputs: what the front end makes of a prompt's `multi_modal_data` and
the engine core carries with the request (MultiModalFeature), and the front end's step
that makes them (MultiModalProcessor).

A vision-language prompt holds one placeholder token per image (Qwen2.5-VL's chat template
writes `<|vision_start|><|image_pad|><|vision_end|>`); the processor turns each image into
the encoder's pixel rows, expands its placeholder into the image's number of embedding
tokens and records where they sit. The image's identifier (a hash of its pixel rows and
grid) keys the encoder cache and the prefix-cache blocks that hold its tokens, so two
prompts with the same text and different images never share KV."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import msgspec
import numpy as np

# vLLM's default limit of items per prompt and modality (--limit-mm-per-prompt).
DEFAULT_LIMIT_PER_PROMPT = 999
# What the chat template writes for an image (Qwen2-VL / Qwen2.5-VL); the chat route puts it
# where an image_url part was when it renders content parts as a string.
QWEN_VL_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a request: its placeholder tokens prompt[offset : offset + length], the
    encoder's input (pixel rows float32 [rows, patch_dim] with the patch grid) and the hash
    that names its encoder output."""

    identifier: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    pixel_values: bytes  # float32 [rows, patch_dim], C order
    patch_dim: int
    modality: str = "image"

    def pixels(self) -> np.ndarray:
        return np.frombuffer(self.pixel_values, np.float32).reshape(-1, self.patch_dim)

    @property
    def end(self) -> int:
        return self.offset + self.length


def parse_limit_mm_per_prompt(value) -> dict[str, int]:
    """--limit-mm-per-prompt: a dict or its JSON ('{"image": 2}'); image counts only."""
    if value is None:
        return {"image": DEFAULT_LIMIT_PER_PROMPT}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt: not JSON ({e}); e.g. '{{\"image\": 2}}'")
    if not isinstance(value, dict):
        raise ValueError("limit_mm_per_prompt must be a dict such as {'image': 2}")
    out = {"image": DEFAULT_LIMIT_PER_PROMPT}
    for k, v in value.items():
        if k not in ("image", "video", "audio"):
            raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r} (image, video, "
                             "audio)")
        n = v.get("count") if isinstance(v, dict) else v
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer >= 0, got {v!r}")
        out[k] = n
    return out


def image_list(data: dict[str, Any]) -> list:
    """multi_modal_data -> its images (a PIL image or a list of them); other modalities are
    refused by name."""
    if not isinstance(data, dict):
        raise ValueError("multi_modal_data must be a dict such as {'image': PIL.Image}")
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data: modality {unknown[0]!r} is not supported "
                         "(supported: image)")
    images = data.get("image")
    if images is None:
        return []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    from PIL import Image

    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}]: expected a PIL image, got "
                             f"{type(im).__name__}")
    return images


class MultiModalProcessor:
    """The front end's image step for a vision-language model: images -> features, the
    prompt's placeholders expanded. Built from the checkpoint's preprocessor_config.json."""

    def __init__(self, model_config, model_dir: str, limits: dict[str, int] | None = None,
                 max_tokens_per_image: int | None = None):
        from jaxinfer.multimodal.qwen2_vl import Qwen2VLImageProcessor

        path = os.path.join(model_dir, "preprocessor_config.json")
        d = {}
        if os.path.exists(path):
            with open(path) as f:
                d = json.load(f)
        vis = model_config.vision
        d.setdefault("patch_size", vis.patch_size)
        d.setdefault("temporal_patch_size", vis.temporal_patch_size)
        d.setdefault("merge_size", vis.spatial_merge_size)
        self.image_processor = Qwen2VLImageProcessor.from_config(d)
        self.image_token_id = model_config.image_token_id
        self.placeholder_text = QWEN_VL_IMAGE_PLACEHOLDER
        self.limits = limits or {"image": DEFAULT_LIMIT_PER_PROMPT}
        # an image must fit one step (its tokens are never split): the token budget
        self.max_tokens_per_image = max_tokens_per_image

    def check_image(self, image) -> int:
        """An image's number of tokens (ValueError if the processor cannot take it or it
        does not fit one step)."""
        n = self.image_processor.num_tokens(image.height, image.width)
        if self.max_tokens_per_image is not None and n > self.max_tokens_per_image:
            raise ValueError(f"{n} tokens, more than the {self.max_tokens_per_image} one step "
                             "can hold (max_num_batched_tokens; an image's tokens are never "
                             "split across steps)")
        return n

    def _placeholders(self, ids: list[int], images: list) -> list[int]:
        limit = self.limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
        if len(images) > limit:
            raise ValueError(f"multi_modal_data: {len(images)} images, more than the limit of "
                             f"{limit} per prompt (--limit-mm-per-prompt)")
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != len(images):
            raise ValueError(f"the prompt has {len(where)} image placeholder(s) for "
                             f"{len(images)} image(s): put one image placeholder token (id "
                             f"{self.image_token_id}) per image (the chat template does)")
        return where

    def expand(self, ids: list[int], images: list) -> list[int]:
        """The prompt with each image's placeholder expanded (no pixel work)."""
        out, start = [], 0
        for at, image in zip(self._placeholders(ids, images), images):
            out += ids[start:at] + [self.image_token_id] * self.check_image(image)
            start = at + 1
        return out + ids[start:]

    def process(self, ids: list[int], images: list) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each image's placeholder expanded, and the images' features."""
        tok = self.image_token_id
        where = self._placeholders(ids, images)
        feats, out = [], []
        start = 0
        for k, (at, image) in enumerate(zip(where, images)):
            try:
                image.load()  # (a truncated or corrupt file fails here, by name)
                pixels, grid = self.image_processor([image])
            except (OSError, ValueError, SyntaxError) as e:
                raise ValueError(f"image {k}: cannot be read or processed: {e}") from None
            g = tuple(int(x) for x in grid[0])
            n = g[0] * g[1] * g[2] // self.image_processor.merge_size ** 2
            try:
                self.check_image(image)
            except ValueError as e:
                raise ValueError(f"image {k}: {e}") from None
            out.extend(ids[start:at])
            offset = len(out)
            out.extend([tok] * n)
            start = at + 1
            raw = np.ascontiguousarray(pixels, np.float32)
            digest = hashlib.sha256(raw.tobytes())
            digest.update(np.asarray(g, np.int64).tobytes())
            feats.append(MultiModalFeature(identifier=digest.hexdigest(), offset=offset,
                                           length=n, grid_thw=g, pixel_values=raw.tobytes(),
                                           patch_dim=raw.shape[1]))
        out.extend(ids[start:])
        return out, feats


def block_mm_keys(features, block_index: int, block_size: int) -> tuple:
    """The identifiers of the images whose tokens fall in block `block_index`."""
    lo, hi = block_index * block_size, (block_index + 1) * block_size
    return tuple(f.identifier for f in features if f.offset < hi and f.end > lo)


def check_features(features, ids, *, image_token_id: int | None, patch_dim: int,
                   merge: int) -> None:
    """The engine core's check of a request's images (a request that bypassed the front end
    fails alone): ValueError naming the field and the limit."""
    if not features:
        return
    if image_token_id is None:
        raise ValueError("mm_features: this model takes text only (no vision encoder)")
    prev_end = 0
    for k, f in enumerate(features):
        name = f"mm_features[{k}]"
        if not isinstance(f, MultiModalFeature) or f.modality != "image":
            raise ValueError(f"{name}: an image feature is expected")
        g = f.grid_thw
        if (len(g) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or not
                               0 < x <= 1 << 16 for x in g)
                or g[1] % merge or g[2] % merge):
            raise ValueError(f"{name}.grid_thw must be 3 positive ints, the last two "
                             f"multiples of {merge}")
        rows = g[0] * g[1] * g[2]
        if f.patch_dim != patch_dim or len(f.pixel_values) != rows * patch_dim * 4:
            raise ValueError(f"{name}.pixel_values must hold {rows} x {patch_dim} float32 "
                             "values")
        if f.length != rows // (merge * merge):
            raise ValueError(f"{name}.length must be {rows // (merge * merge)} for its grid")
        if not (prev_end <= f.offset and f.end <= len(ids)):
            raise ValueError(f"{name}: offset {f.offset} + length {f.length} must lie in the "
                             "prompt, after the previous image")
        if any(t != image_token_id for t in ids[f.offset:f.end]):
            raise ValueError(f"{name}: the prompt must hold the image token at its "
                             f"{f.length} positions")
        if not (isinstance(f.identifier, str) and 0 < len(f.identifier) <= 128):
            raise ValueError(f"{name}.identifier must be a string of 1 to 128 characters")
        if not np.isfinite(f.pixels()).all():
            raise ValueError(f"{name}.pixel_values must be finite")
        prev_end = f.end
    if sum(t == image_token_id for t in ids) != sum(f.length for f in features):
        raise ValueError("prompt_token_ids: every image token must belong to an image of "
                         "mm_features")
