"""Images as request inputs: what the front end makes of a prompt's `multi_modal_data` and
the engine core carries with the request (MultiModalFeature), and the front end's step
that makes them (MultiModalProcessor).

A vision-language prompt holds one placeholder token per image (Qwen2.5-VL's chat template
writes `<|vision_start|><|image_pad|><|vision_end|>`, Gemma 3's `<start_of_image>`); the
processor turns each image into the encoder's pixel rows, expands its placeholder into the
image's number of embedding tokens (Gemma 3: "\n\n<start_of_image>", the soft tokens,
"<end_of_image>\n\n", as HF's processor writes it) and records where they sit. The
image's identifier (a hash of its pixel rows and grid) keys the encoder cache and the
prefix-cache blocks that hold its tokens, so two prompts with the same text and different
images never share KV."""

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
        from jaxinfer.config.vision import Gemma3VisionConfig

        path = os.path.join(model_dir, "preprocessor_config.json")
        d = {}
        if os.path.exists(path):
            with open(path) as f:
                d = json.load(f)
        vis = model_config.vision
        self.image_token_id = model_config.image_token_id
        # the prompt's one token per image, and the tokens written around its embedding tokens
        self.prompt_token_id = self.image_token_id
        self.before: tuple[int, ...] = ()
        self.after: tuple[int, ...] = ()
        self.newlines: dict[int, int] = {}  # (Gemma 3) k -> the token of k newlines
        if isinstance(vis, Gemma3VisionConfig):
            from jaxinfer.multimodal.gemma3 import Gemma3ImageProcessor, newline_tokens

            self.image_processor = Gemma3ImageProcessor.from_config(d, vis)
            self.prompt_token_id = vis.boi_token_id
            self.newlines = newline_tokens(model_dir)
            self.placeholder_text = "<start_of_image>"  # (what Gemma 3's template writes)
            if 2 in self.newlines:
                nl = self.newlines[2]
                self.before, self.after = (nl, vis.boi_token_id), (vis.eoi_token_id, nl)
        else:
            from jaxinfer.multimodal.qwen2_vl import Qwen2VLImageProcessor

            d.setdefault("patch_size", vis.patch_size)
            d.setdefault("temporal_patch_size", vis.temporal_patch_size)
            d.setdefault("merge_size", vis.spatial_merge_size)
            self.image_processor = Qwen2VLImageProcessor.from_config(d)
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
        where = [i for i, t in enumerate(ids) if t == self.prompt_token_id]
        if len(where) != len(images):
            raise ValueError(f"the prompt has {len(where)} image placeholder(s) for "
                             f"{len(images)} image(s): put one image placeholder token (id "
                             f"{self.prompt_token_id}) per image (the chat template does)")
        if where and self.prompt_token_id != self.image_token_id and not self.before:
            raise ValueError("Gemma 3 images need the checkpoint's tokenizer.json (the "
                             "newline tokens written around each image), which was not found")
        return where

    def _newline_count(self, token: int) -> int:
        return next((k for k, t in self.newlines.items() if t == token), 0)

    def _layout(self, ids: list[int], where: list[int], counts: list[int]):
        """The expanded prompt and each image's first embedding token: each placeholder
        replaced by before + its tokens + after; a run of newlines the prompt has next to
        the newlines written around an image becomes one token where the vocabulary has it
        (the text HF's processor tokenizes would give that token)."""
        out, offsets, start = [], [], 0
        for at, n in zip(where, counts):
            out += ids[start:at]
            before = list(self.before)
            c = self._newline_count(out[-1]) if before and out else 0
            if c and c + self._newline_count(before[0]) in self.newlines:
                out[-1] = self.newlines[c + self._newline_count(before[0])]
                before = before[1:]
            out += before
            offsets.append(len(out))
            out += [self.image_token_id] * n
            after = list(self.after)
            start = at + 1
            if after and start < len(ids) and start not in where and self.newlines:
                c = self._newline_count(ids[start])
                k = c + self._newline_count(after[-1])
                if c and k in self.newlines:
                    after[-1] = self.newlines[k]
                    start += 1
            out += after
        return out + ids[start:], offsets

    def expand(self, ids: list[int], images: list) -> list[int]:
        """The prompt with each image's placeholder expanded (no pixel work)."""
        where = self._placeholders(ids, images)
        return self._layout(ids, where, [self.check_image(im) for im in images])[0]

    def process(self, ids: list[int], images: list) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each image's placeholder expanded, and the images' features."""
        where = self._placeholders(ids, images)
        feats, counts = [], []
        for k, image in enumerate(images):
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
            counts.append(n)
            raw = np.ascontiguousarray(pixels, np.float32)
            digest = hashlib.sha256(raw.tobytes())
            digest.update(np.asarray(g, np.int64).tobytes())
            feats.append(MultiModalFeature(identifier=digest.hexdigest(), offset=0,
                                           length=n, grid_thw=g, pixel_values=raw.tobytes(),
                                           patch_dim=raw.shape[1]))
        out, offsets = self._layout(ids, where, counts)
        for f, offset in zip(feats, offsets):
            f.offset = offset
        return out, feats


def block_mm_keys(features, block_index: int, block_size: int) -> tuple:
    """The identifiers of the images whose tokens fall in block `block_index`."""
    lo, hi = block_index * block_size, (block_index + 1) * block_size
    return tuple(f.identifier for f in features if f.offset < hi and f.end > lo)


def check_features(features, ids, *, image_token_id: int | None, patch_dim: int,
                   merge: int, grid: tuple[int, int, int] | None = None) -> None:
    """The engine core's check of a request's images (a request that bypassed the front end
    fails alone): ValueError naming the field and the limit. grid: the one grid every image
    has (Gemma 3's fixed size), or None."""
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
        if grid is not None and tuple(g) != tuple(grid):
            raise ValueError(f"{name}.grid_thw must be {list(grid)} (this model's one image "
                             "size)")
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
