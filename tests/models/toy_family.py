"""A toy model family, written as a new family is (docs/adding_a_model.md): this file and one
registry row (test_registry.py registers it). Llama attention from models/llama.py; its own
feed-forward block, a non-gated MLP with a squared ReLU whose checkpoint tensors are
`mlp.up.weight` [I, H] and `mlp.down.weight` [H, I]. The parameters' declarations (logical
axes and HF layout, made by Linear) are all the loader and the shardings need."""

from __future__ import annotations

import jax
from flax import nnx

from jaxinfer.layers.linear import Linear
from jaxinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class ReluSquaredMLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, *, dtype, rngs, packed):
        self.up = Linear(hidden, inter, use_bias=False, dtype=dtype, rngs=rngs, packed=packed,
                         axes=("embed", "mlp"))
        self.down = Linear(inter, hidden, use_bias=False, dtype=dtype, rngs=rngs,
                           packed=packed, axes=("mlp", "embed"))

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)) ** 2)


class ToyDecoderLayer(LlamaDecoderLayer):
    def make_ffn(self, cfg, layer_idx, *, dtype, rngs, mesh, packed):
        return "mlp", ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype,
                                     rngs=rngs, packed=packed)


class ToyForCausalLM(LlamaForCausalLM):
    layer_cls = ToyDecoderLayer
