"""The runner's side of images (vision-language engines): the vision encoder's runs, the
encoder outputs kept by image identifier (the scheduler's EncoderCacheManager decides what
is encoded and dropped), and what each step carries for them: the encoder rows to put in
place of the placeholder tokens' embeddings (StepBatch.mm_embeds / mm_mask, the `mm`
variant), for models whose image tokens attend both ways (Gemma 3) each image token's span
(AttentionMetadata.attn_spans, in the same steps) and, for M-RoPE models, every token's
three rotary positions (StepBatch.rope_positions, every step).

Encoder runs: one image at a time, its inputs padded by the model family
(`encoder_inputs`: Qwen2.5-VL pads the patches to a power of two, at least 64, so that the
tower compiles once per such size on first use; at most 8 sizes for its default
max_pixels); the padding rows are dropped. The output comes back to the host (float32) and
goes into the steps that place the image's tokens."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

logger = logging.getLogger(__name__)

MIN_PATCH_BUCKET = 64


@dataclasses.dataclass
class _RequestImages:
    features: tuple  # MultiModalFeature, in prompt order
    rope: np.ndarray | None  # int32 [3, prompt tokens] (M-RoPE models)
    delta: int  # decode positions: p + delta in all three


def _encode(graphdef, state, *args):
    """The tower over one image's padded inputs (the model's encoder_inputs)."""
    return nnx.merge(graphdef, state)(*args).astype(jnp.float32)


class MultiModalRunner:
    def __init__(self, model):
        """model: a vision-language model: its `visual` tower, the class functions
        `encoder_inputs` (one image's padded tower inputs) and `mm_rope_positions` (M-RoPE
        models), `bidirectional_images` (Gemma 3)."""
        self.config = model.config
        # (the tower's weights are read from the step state's at each run: a weight update or
        # a wake-up replaces them there)
        self.graphdef = nnx.split(model.visual)[0]
        self.hidden_size = model.config.hidden_size
        self.mrope = bool(model.config.mrope_section)
        self.spans = bool(getattr(model, "bidirectional_images", False))
        self.model_cls = type(model)
        self._encode = jax.jit(_encode, static_argnums=(0,))
        self.outputs: dict[str, np.ndarray] = {}  # identifier -> float32 [rows, H]
        self.requests: dict[str, _RequestImages] = {}
        self.num_encoder_runs = 0
        self.compiled_sizes: set[int] = set()

    # -- the scheduler's diff -------------------------------------------------------------------
    @staticmethod
    def tower_state(params):
        """The vision tower's weights in a step state's params (a whole model's state, or
        a layer-wise program's (shell state, layers))."""
        return (params[0] if isinstance(params, tuple) else params)["visual"]

    def apply(self, so, params) -> dict[str, str]:
        """Drop what the scheduler freed, take the new requests' images and run the step's
        encoder inputs with the tower's weights in `params` (the step state's). Returns the
        requests whose images could not be encoded (id -> error): they fail alone."""
        for key in so.free_encoder_mm_hashes:
            self.outputs.pop(key, None)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests.pop(new.req_id, None)
            if new.mm_features:
                rope, delta = None, 0
                if self.mrope:
                    rope, delta = self.model_cls.mm_rope_positions(
                        self.config, new.token_ids[:new.num_prompt_tokens], new.mm_features)
                self.requests[new.req_id] = _RequestImages(tuple(new.mm_features), rope, delta)
        failed = {}
        for rid, which in so.scheduled_encoder_inputs.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            for k in which:
                f = req.features[k]
                if f.identifier in self.outputs:
                    continue
                try:
                    self.outputs[f.identifier] = self.encode(f, params)
                except Exception as e:  # noqa: BLE001 - that request fails, the step goes on
                    logger.exception("encoding image %d of request %s failed", k, rid)
                    failed[rid] = f"engine error while encoding image {k}: {type(e).__name__}: {e}"
        return failed

    def encode(self, feature, params) -> np.ndarray:
        """One image's encoder output, float32 [feature.length, H], in image order."""
        args, rows, unmerge = self.model_cls.encoder_inputs(self.config, feature,
                                                            MIN_PATCH_BUCKET)
        out = self._encode(self.graphdef, self.tower_state(params), *args)
        self.compiled_sizes.add(args[0].shape[0])
        self.num_encoder_runs += 1
        out = np.asarray(jax.device_get(out))
        return out.reshape(-1, out.shape[-1])[:rows][unmerge]

    # -- one step's inputs ----------------------------------------------------------------------
    def step_images(self, req_ids, computed, q_lens) -> list[tuple[int, np.ndarray, tuple]]:
        """(first token index in the step, encoder rows, the image's (first, last)
        position) of every image part the step's chunks hold, in token order."""
        out = []
        if not self.requests:  # (no request with images: no per-row work)
            return out
        start = 0
        for rid, c, q in zip(req_ids, computed.tolist(), q_lens.tolist()):
            req = self.requests.get(rid)
            if req is not None:
                for f in req.features:
                    lo, hi = max(f.offset, c), min(f.end, c + q)
                    if lo < hi:
                        rows = self.outputs[f.identifier][lo - f.offset:hi - f.offset]
                        out.append((start + lo - c, rows, (f.offset, f.end - 1)))
            start += q
        return out

    def fill(self, batch, parts) -> None:
        spans = batch.attn.attn_spans
        for at, rows, span in parts:
            batch.mm_embeds[at:at + len(rows)] = rows
            batch.mm_mask[at:at + len(rows)] = True
            if spans is not None:
                spans[at:at + len(rows)] = span

    def fill_rope(self, batch, req_ids, computed, q_lens, pos) -> None:
        """M-RoPE positions of the step's tokens: the prompt table of a request with images
        (its later tokens at p + delta), p in all three for the others."""
        n = len(pos)
        rope = batch.rope_positions
        rope[:, :n] = pos
        if not self.requests:
            return
        start = 0
        for rid, c, q in zip(req_ids, computed.tolist(), q_lens.tolist()):
            req = self.requests.get(rid)
            if req is not None:
                p = pos[start:start + q]
                table = req.rope
                inside = p < table.shape[1]
                rope[:, start:start + q] = np.where(
                    inside, table[:, np.minimum(p, table.shape[1] - 1)], p + req.delta)
            start += q
