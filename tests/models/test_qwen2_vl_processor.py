"""The Qwen2-VL image processor (jaxinfer/multimodal/qwen2_vl.py) against HF's PIL one."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.multimodal.qwen2_vl import Qwen2VLImageProcessor

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")


def _hf(**kwargs):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    return Qwen2VLImageProcessorPil(**kwargs)


def _image(h, w, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    shape = (h, w) if mode == "L" else (h, w, len(mode))
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


@pytest.mark.parametrize("config", [{}, {"max_pixels": 28 * 28 * 64},
                                    {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 16},
                                    {"size": {"shortest_edge": 3136, "longest_edge": 50176},
                                     "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                                     "image_std": [0.5, 0.5, 0.5]}])
def test_pixels_and_grids_equal_hf(config):
    # upscaled (tiny, one side < the factor), downscaled (over max_pixels), extreme aspect
    # ratios, grey and RGBA images
    images = [_image(60, 90), _image(10, 1900, seed=1), _image(640, 480, seed=2),
              _image(300, 41, "L", seed=3), _image(33, 70, "RGBA", seed=4), _image(28, 28)]
    ref = _hf(**config)(images=images, return_tensors="np")
    ours = Qwen2VLImageProcessor.from_config(config)
    pixels, grids = ours(images)
    assert grids.tolist() == ref["image_grid_thw"].tolist()
    np.testing.assert_allclose(pixels, ref["pixel_values"], rtol=0, atol=1e-6)
    hf = _hf(**config)
    for im, (t, h, w) in zip(images, grids):
        assert ours.num_tokens(im.height, im.width) == t * h * w // 4 \
            == hf.get_number_of_image_patches(im.height, im.width) // 4


def test_bad_images_are_refused_by_name():
    p = Qwen2VLImageProcessor()
    with pytest.raises(ValueError, match="aspect ratio"):
        p.num_tokens(10, 2500)
    with pytest.raises(ValueError, match="must be >= 1"):
        p([Image.new("RGB", (0, 12))])
    with pytest.raises(ValueError, match="min_pixels"):
        Qwen2VLImageProcessor.from_config({"min_pixels": 10_000, "max_pixels": 100})
