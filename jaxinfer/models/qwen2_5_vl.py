"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): a Qwen2 language model with M-RoPE and
the `visual` tower.

Served with images (docs/multimodal.md): the runner (runner/multimodal.py) runs the tower
per image and puts its rows in place of the placeholder tokens' embeddings, with each
request's M-RoPE positions (`mm_rope_positions`) in every step.

M-RoPE. Of the head_dim / 2 rotary frequencies the first mrope_section[0] turn with a token's
temporal position, the next mrope_section[1] with its row, the last with its column. A text
token's three positions are equal (plain rope: text-only steps pass positions [T]); an
image's placeholder tokens sit at (start + frame, start + row, start + column) of its merged
grid, and the text after it continues from start + max(rows, columns) (mrope_positions);
decode positions are offset by the prompt's delta.

The tower. An image of grid (t, h, w) patches arrives as rows of C x T x P x P pixels (the
processor's `pixel_values`; T = temporal_patch_size frames, P = patch_size), each row one
patch, grouped so that every spatial_merge_size x spatial_merge_size square of patches is
consecutive. A linear patch embedding (HF's Conv3d with stride = kernel, flattened), then
`depth` pre-norm blocks (RMSNorm, attention with a 2-D rotary embedding, RMSNorm, a gated
MLP with biases), then the merger: RMSNorm, each square of 4 patches concatenated, a
Linear-GELU-Linear MLP to the language model's width. The rotary angles of a patch are its
row (first quarter of the head) and column (second quarter) times the usual inverse
frequencies over head_dim / 2, repeated over both halves. Attention is bidirectional within
an image in the `fullatt_block_indexes` blocks and within windows of window_size pixels
(window_size / patch_size / spatial_merge_size merged units a side) in the others: the
patches are reordered window by window (host-side, `vision_plan`), both kinds of attention
are a segment mask over the reordered patches, and the merged outputs are put back in
image order at the end.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.config.vision import VisionConfig
from jaxinfer.layers import module_list
from jaxinfer.layers.linear import Linear
from jaxinfer.layers.norms import RMSNorm
from jaxinfer.layers.params import HF
from jaxinfer.layers.rotary import apply_rotary, rope_tables
from jaxinfer.models.llama import LlamaForCausalLM

_VISION_NORM_EPS = 1e-6  # (HF's vision RMSNorms)


@dataclasses.dataclass(frozen=True)
class VisionPlan:
    """Host-side (numpy) layout of one encoder run over images of grids `grid_thw`: N patches
    in window order. perm [N]: the processor's patch row at each position; cos / sin
    [N, head_dim / 2]: rotary tables; image_seg / window_seg [N]: the attention segments of
    full (each frame of each image) and windowed blocks; unmerge [N / merge^2]: merged rows
    back in image order."""

    perm: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    image_seg: np.ndarray
    window_seg: np.ndarray
    unmerge: np.ndarray


def vision_plan(cfg: VisionConfig, grid_thw) -> VisionPlan:
    m = cfg.spatial_merge_size
    unit = m * m
    win = cfg.window_size // m // cfg.patch_size  # merged units per window side
    quarter = cfg.head_dim // 4
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, 2 * quarter, 2) / (2 * quarter)))
    order, hw, image_seg, window_seg = [], [], [], []
    base = windows = frames = 0
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3):
        if h % m or w % m:
            raise ValueError(f"image grid {h} x {w} is not a multiple of the merge size {m}")
        gh, gw = h // m, w // m
        # Patch rows come square by square: (row block, col block, row in, col in).
        rows = np.arange(h).reshape(gh, m, 1, 1)
        cols = np.arange(w).reshape(1, 1, gw, m)
        rr = np.broadcast_to(rows, (gh, m, gw, m)).transpose(0, 2, 1, 3).reshape(-1)
        cc = np.broadcast_to(cols, (gh, m, gw, m)).transpose(0, 2, 1, 3).reshape(-1)
        # Merged units (gh x gw per frame) grouped window by window, row-major inside.
        ph, pw = -gh % win, -gw % win  # (HF pads to whole windows, then drops the padding)
        for f in range(t):
            idx = np.full((gh + ph, gw + pw), -1)
            idx[:gh, :gw] = np.arange(gh * gw).reshape(gh, gw) + f * gh * gw
            blocks = idx.reshape((gh + ph) // win, win, (gw + pw) // win, win)
            blocks = blocks.transpose(0, 2, 1, 3).reshape(-1, win * win)
            for blk in blocks:
                units = blk[blk >= 0]
                if not len(units):
                    continue
                patch_idx = (units[:, None] * unit + np.arange(unit)).reshape(-1)
                order.append(base + patch_idx)
                local = patch_idx % (h * w)
                hw.append(np.stack([rr[local], cc[local]], axis=-1))
                image_seg.append(np.full(len(patch_idx), frames + f))
                window_seg.append(np.full(len(patch_idx), windows))
                windows += 1
        base += t * h * w
        frames += t
    perm = np.concatenate(order)
    pos = np.concatenate(hw).astype(np.float64)  # [N, 2]: row, column
    angles = np.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1)
    units = perm[::unit] // unit  # the merged unit at each merged position
    return VisionPlan(perm=perm.astype(np.int32), cos=np.cos(angles).astype(np.float32),
                      sin=np.sin(angles).astype(np.float32),
                      image_seg=np.concatenate(image_seg).astype(np.int32),
                      window_seg=np.concatenate(window_seg).astype(np.int32),
                      unmerge=np.argsort(units).astype(np.int32))


def segment_attention(q, k, v, seg, scale: float, chunk: int = 512):
    """Bidirectional attention of each row with the rows of its segment: q, k, v [N, H, D],
    seg int32 [N] -> [N, H, D]. Queries go `chunk` rows at a time (scores [H, chunk, N])."""
    n = q.shape[0]
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

    def rows(qc, sc):
        s = jnp.einsum("qhd,khd->hqk", qc.astype(jnp.float32), k32) * scale
        s = jnp.where(sc[None, :, None] == seg[None, None, :], s, -jnp.inf)
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v32)

    if n <= chunk:
        return rows(q, seg).astype(q.dtype)
    pad = -n % chunk
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, chunk, *q.shape[1:])
    sp = jnp.pad(seg, (0, pad), constant_values=-1).reshape(-1, chunk)
    out = jax.lax.map(lambda a: rows(*a), (qp, sp))
    return out.reshape(-1, *q.shape[1:])[:n].astype(q.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs):
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, use_bias=True, dtype=dtype,
                          rngs=rngs)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, use_bias=True, dtype=dtype,
                           rngs=rngs)

    def __call__(self, x, cos, sin, seg):
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)
        q, k = apply_rotary(qkv[:, 0], cos, sin), apply_rotary(qkv[:, 1], cos, sin)
        o = segment_attention(q, k, qkv[:, 2], seg, self.head_dim ** -0.5)
        return self.proj(o.reshape(n, -1))


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, use_bias=True, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, use_bias=True, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, use_bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, full: bool, *, dtype, rngs):
        self.full = full  # attention over the whole image (else within its window)
        self.norm1 = RMSNorm(cfg.hidden_size, _VISION_NORM_EPS, dtype=dtype)
        self.attn = VisionAttention(cfg, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(cfg.hidden_size, _VISION_NORM_EPS, dtype=dtype)
        self.mlp = VisionMLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, image_seg, window_seg):
        x = x + self.attn(self.norm1(x), cos, sin, image_seg if self.full else window_seg)
        return x + self.mlp(self.norm2(x))


class _Gelu(nnx.Module):  # (the merger MLP's middle entry: HF's nn.GELU, exact)
    def __call__(self, x):
        return jax.nn.gelu(x, approximate=False)


class PatchMerger(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs):
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, _VISION_NORM_EPS, dtype=dtype)
        self.mlp = module_list([
            Linear(self.width, self.width, use_bias=True, dtype=dtype, rngs=rngs), _Gelu(),
            Linear(self.width, cfg.out_hidden_size, use_bias=True, dtype=dtype, rngs=rngs)])

    def __call__(self, x):
        x = self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class PatchEmbed(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs):
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size, use_bias=False, dtype=dtype,
                           rngs=rngs)
        # HF's Conv3d kernel [out, C, T, P, P] is this matmul's weight, flattened
        self.proj.weight.set_metadata(hf=HF(("{module}.weight",), transpose=True, flatten=True))

    def __call__(self, x):
        return self.proj(x)


class Qwen2_5VisionTransformer(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.blocks = module_list(
            VisionBlock(cfg, i in cfg.fullatt_block_indexes, dtype=dtype, rngs=rngs)
            for i in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, patches, cos, sin, image_seg, window_seg):
        """patches [N, patch_dim] in window order (VisionPlan.perm), the plan's tables ->
        merged embeddings [N / merge^2, out_hidden_size] in window order (VisionPlan.unmerge
        puts them back in image order)."""
        x = self.patch_embed(patches.astype(self.patch_embed.proj.weight.dtype))
        for block in self.blocks:
            x = block(x, cos, sin, image_seg, window_seg)
        return self.merger(x)

    def encode(self, pixel_values, grid_thw) -> jax.Array:
        """The processor's pixel_values [N, patch_dim] and image grids -> embeddings
        [N / merge^2, out_hidden_size] in image order (HF's pooler_output)."""
        plan = vision_plan(self.config, grid_thw)
        out = self(jnp.asarray(pixel_values)[plan.perm], jnp.asarray(plan.cos),
                   jnp.asarray(plan.sin), jnp.asarray(plan.image_seg),
                   jnp.asarray(plan.window_seg))
        return out[plan.unmerge]


def mrope_tables(positions, head_dim: int, theta: float, section: tuple[int, ...]):
    """M-RoPE: positions int32 [3, T] (temporal, row, column) -> cos, sin [T, head_dim / 2]:
    the first section[0] frequencies turn with the temporal position, the next section[1]
    with the row, the last with the column."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    comp = np.repeat(np.arange(3), section)  # [head_dim / 2]: whose position turns it
    angles = positions[comp].T.astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def mrope_positions(token_ids, image_token_id: int, grid_thw, merge: int
                    ) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a prompt (HF's get_rope_index, images): int64 [3, T] and the
    offset of every later position (decode: position p is p + delta in all three). A text
    token advances all three by one; an image of (t, h, w) patches takes its
    t x (h / merge) x (w / merge) placeholder tokens at (start + frame, start + row,
    start + column) and advances the start by max(h, w) / merge."""
    ids = np.asarray(token_ids)
    grids = [tuple(int(x) for x in g) for g in np.asarray(grid_thw).reshape(-1, 3)]
    pos = np.zeros((3, len(ids)), np.int64)
    i = cur = image = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            pos[:, i] = cur
            cur, i = cur + 1, i + 1
            continue
        if image == len(grids):
            raise ValueError(f"the prompt has more image placeholder tokens than the "
                             f"{len(grids)} image(s) need")
        t, h, w = grids[image]
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if not (ids[i:i + n] == image_token_id).all():
            raise ValueError(f"image {image} needs {n} consecutive placeholder tokens")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, i:i + n] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + cur
        cur, i, image = cur + max(gh, gw), i + n, image + 1
    if image != len(grids):
        raise ValueError(f"the prompt has placeholder tokens for {image} of its {len(grids)} "
                         "images")
    return pos, int(pos.max(initial=-1)) + 1 - len(ids)


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """The language model (Qwen2's: q/k/v biases) with M-RoPE, and the vision tower
    (`visual`). Text-only steps take positions [T] (M-RoPE with three equal positions is
    plain rope); steps with images take positions [3, T] (mrope_positions) and the input
    embeddings with the tower's outputs at the placeholder tokens (`embeds`)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, mesh=None, packed: bool = False):
        super().__init__(cfg, dtype=dtype, attention_backend=attention_backend, rngs=rngs,
                         mesh=mesh, packed=packed)
        self.visual = Qwen2_5VisionTransformer(cfg.vision, dtype=dtype, rngs=rngs)

    @staticmethod
    def encoder_inputs(cfg: ModelConfig, feature, min_size: int) -> tuple[tuple, int, np.ndarray]:
        """One image's tower inputs (multimodal/inputs.py feature), its patches in window
        order padded to a power of two (>= min_size, so that the tower compiles once per
        size class): (the tower's arguments, its real output rows, the permutation back to
        image order). Padding patches form segments of their own, one per merge unit: no
        real patch attends to them."""
        vis = cfg.vision
        plan = vision_plan(vis, [feature.grid_thw])
        pixels = feature.pixels()
        n = len(plan.perm)
        size = max(min_size, 1 << (n - 1).bit_length())
        patches = np.zeros((size, pixels.shape[1]), np.float32)
        patches[:n] = pixels[plan.perm]
        half = plan.cos.shape[1]
        cos = np.ones((size, half), np.float32)
        sin = np.zeros((size, half), np.float32)
        cos[:n], sin[:n] = plan.cos, plan.sin
        unit = vis.spatial_merge_size ** 2
        pad_seg = -1 - np.arange(size - n, dtype=np.int32) // unit
        args = (patches, cos, sin, np.concatenate([plan.image_seg, pad_seg]),
                np.concatenate([plan.window_seg, pad_seg]))
        return args, n // unit, plan.unmerge

    @staticmethod
    def mm_rope_positions(cfg: ModelConfig, prompt_ids, features) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions int32 [3, P] and the offset of its later positions,
        from its images' features (multimodal/inputs.py)."""
        pos, delta = mrope_positions(prompt_ids, cfg.image_token_id,
                                     [f.grid_thw for f in features],
                                     cfg.vision.spatial_merge_size)
        return pos.astype(np.int32), delta

    @staticmethod
    def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        if positions.ndim == 1:
            return rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return mrope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
