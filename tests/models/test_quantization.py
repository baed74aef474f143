"""Quantized weights (fp8 / int8, at load and from checkpoints) and the fp8 KV cache through
the engine."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.config.quant import QuantConfig
from jaxinfer.layers import cpu_kernels
from jaxinfer.layers.quantization import (dequantize, expand_checkpoint_scale, pack_nibbles,
                                         qmatmul, quantize, to_nibbles)

DTYPES = ["int8", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_error_within_the_format(dtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32) * np.linspace(0.01, 2, 40)
    w[:, 7] = 0.0  # a zero column: scale 1, values 0
    q, s = quantize(w, dtype)
    assert q.dtype == np.dtype(dtype) and s.shape == (1, 40) and s[0, 7] == 1.0
    err = np.abs(dequantize(q, s) - w)
    if dtype == "int8":  # rounding: half a step of each column's scale
        assert np.all(err <= s / 2 + 1e-7)
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 * scale
        assert np.all(err <= np.maximum(np.abs(w) * 2.0 ** -4, s * 2.0 ** -10) + 1e-7)
    assert np.max(np.abs(q.astype(np.float32))) == (127 if dtype == "int8" else 448)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels could not be built")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 6, 13])
def test_cpu_kernel_matches_dequantized_product(dtype, m):
    """The packed kernel on int8 / fp8 panels = x @ (q * scale) (a partial last panel)."""
    rng = np.random.default_rng(m)
    k, n = 72, 70
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    x = rng.standard_normal((m, k)).astype(np.float32)
    q, s = quantize(w, dtype)
    ref = x @ dequantize(q, s)
    got = jax.jit(lambda x, p, s: cpu_kernels.matmul(x, p, n, s))(x, cpu_kernels.pack(q),
                                                                 cpu_kernels.pack(s))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    xla = qmatmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), (n,))
    np.testing.assert_allclose(np.asarray(xla), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels could not be built")
def test_cpu_kernel_decodes_every_fp8_value_exactly():
    vals = np.arange(256, dtype=np.uint8)
    vals = vals[(vals & 0x7F) != 0x7F].view(ml_dtypes.float8_e4m3fn)  # (no NaNs)
    w = np.zeros((len(vals), 32), ml_dtypes.float8_e4m3fn)
    w[:, 3] = vals
    got = cpu_kernels.matmul(np.eye(len(vals), dtype=np.float32), cpu_kernels.pack(w), 32,
                             cpu_kernels.pack(np.ones((1, 32), np.float32)))
    assert np.array_equal(np.asarray(got)[:, 3], vals.astype(np.float32))


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels could not be built")
@pytest.mark.parametrize("group,offset", [(16, True), (32, True), (32, False), (3, True)])
@pytest.mark.parametrize("m", [1, 7, 13])
def test_cpu_kernel_groups_with_offsets(group, offset, m):
    """GGUF-style groups of input rows, each with a scale and an offset per column:
    x @ (q * s + o), for the kernel and for XLA's path (groups of 3: an odd row closes each)."""
    rng = np.random.default_rng(group + m)
    k, n = 96, 45
    q = rng.integers(0, 16, (k, n)).astype(np.int8)
    s = rng.uniform(0.001, 0.02, (k // group, n)).astype(np.float32)
    o = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32) if offset else None
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = x @ dequantize(q, s, group, o)
    got = cpu_kernels.matmul(x, cpu_kernels.pack(q), n, cpu_kernels.pack(s),
                             None if o is None else cpu_kernels.pack(o))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    xla = qmatmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), (n,), in_block=group,
                  offset=None if o is None else jnp.asarray(o))
    np.testing.assert_allclose(np.asarray(xla), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels could not be built")
@pytest.mark.parametrize("lo", [0, -8])  # Q4_1 / Q4_K codes, Q4_0's
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m", [1, 2, 7, 13])  # (13: the panel widened once)
def test_cpu_kernel_4bit_codes(lo, group, m):
    """Values spanning 16 codes, packed two to a byte (the lowest code folded into the
    offsets) = x @ (q * s + o)."""
    rng = np.random.default_rng(group + m - lo)
    k, n = 96, 45
    q = rng.integers(lo, lo + 16, (k, n)).astype(np.int8)
    q[0, 0], q[1, 1] = lo, lo + 15  # both ends present
    s = rng.uniform(0.001, 0.02, (k // group, n)).astype(np.float32)
    o = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = x @ dequantize(q, s, group, o)
    codes, o2 = to_nibbles(q, s, o)
    assert codes.dtype == np.uint8 and codes.min() == 0 and codes.max() == 15
    w = pack_nibbles(cpu_kernels.pack(codes))
    assert w.shape == (2, k // 2, 32) and w.dtype == np.uint8
    got = cpu_kernels.matmul(x, w, n, cpu_kernels.pack(s), cpu_kernels.pack(o2))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels could not be built")
@pytest.mark.parametrize("kind", ["int8", "4bit"])
@pytest.mark.parametrize("m", [1, 5, 12])
def test_cpu_kernel_claims_of_many_small_panels(kind, m):
    """Below 12 rows a thread claims at least 64 KiB of panels at a time: 100 panels of
    64 x 32 codes (1 or 2 KiB each) go in claims of 32 or 64 panels, the last one short;
    every column is computed once and right, with the threads sharing the claims."""
    rng = np.random.default_rng(m + len(kind))
    k, n, group = 64, 100 * 32 - 7, 32
    q = rng.integers(0, 16, (k, n)).astype(np.int8)
    s = rng.uniform(0.001, 0.02, (k // group, n)).astype(np.float32)
    o = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(q, s, group, o)
    if kind == "4bit":
        codes, o2 = to_nibbles(q, s, o)
        w, off = pack_nibbles(cpu_kernels.pack(codes)), cpu_kernels.pack(o2)
    else:
        w, off = cpu_kernels.pack(q), cpu_kernels.pack(o)
    got = cpu_kernels.matmul(x, w, n, cpu_kernels.pack(s), off)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels could not be built")
@pytest.mark.parametrize("kind", ["int8", "4bit"])
@pytest.mark.parametrize("m", [1, 13])
def test_cpu_kernel_gated_quantized(kind, m):
    """A quantized down projection from the gate-up product: (silu(gate) * up) @ (q * s + o),
    the activation made in the kernel (int8 codes with per-group scales and offsets; 4-bit
    codes two to a byte)."""
    rng = np.random.default_rng(m + len(kind))
    k, n, group = 96, 45, 32
    q = rng.integers(0, 16, (k, n)).astype(np.int8)
    s = rng.uniform(0.001, 0.02, (k // group, n)).astype(np.float32)
    o = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32)
    x = (3 * rng.standard_normal((m, 2 * k))).astype(np.float32)
    g, u = np.split(x.astype(np.float64), 2, axis=1)
    ref = (g / (1 + np.exp(-g)) * u) @ dequantize(q, s, group, o)
    if kind == "4bit":
        codes, o2 = to_nibbles(q, s, o)
        w, off = pack_nibbles(cpu_kernels.pack(codes)), cpu_kernels.pack(o2)
    else:
        w, off = cpu_kernels.pack(q), cpu_kernels.pack(o)
    got = cpu_kernels.gated_matmul(x, w, n, "silu", cpu_kernels.pack(s), off)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)


def test_to_nibbles_only_for_4bit_codes():
    s, o = np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)
    q = np.zeros((32, 3), np.int8)
    q[0, 0] = 16  # 17 codes
    assert to_nibbles(q, s, o) is None
    q[0, 0] = -7
    assert to_nibbles(q, s, o)[0].max() == 7
    assert to_nibbles(np.zeros((30, 3), np.int8), np.ones((2, 3), np.float32),
                      np.zeros((2, 3), np.float32)) is None  # groups of 15 would split bytes


def test_block_scales_with_a_short_last_block():
    """Block-wise (128 x 128 style) scales over an input not divisible by the block."""
    rng = np.random.default_rng(3)
    out_f, in_f, bn, bk = 40, 100, 16, 48  # 3 x 3 blocks, the last ones short
    q = (rng.standard_normal((out_f, in_f)) * 100).clip(-448, 448).astype(
        ml_dtypes.float8_e4m3fn)
    s_hf = rng.uniform(0.001, 0.01, (3, 3)).astype(np.float32)
    s = expand_checkpoint_scale(s_hf, out_f, in_f, (bn, bk))  # [KB, out]
    assert s.shape == (3, out_f)
    want = q.astype(np.float32) * np.repeat(np.repeat(s_hf, bn, 0)[:out_f], bk, 1)[:, :in_f]
    np.testing.assert_array_equal(dequantize(q.T, s, bk), want.T)
    x = rng.standard_normal((3, in_f)).astype(np.float32)
    got = qmatmul(jnp.asarray(x), jnp.asarray(q.T), jnp.asarray(s), (out_f,), in_block=bk)
    np.testing.assert_allclose(np.asarray(got), x @ want.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"needs \(3, 3\)"):
        expand_checkpoint_scale(s_hf[:2], out_f, in_f, (bn, bk))


def test_w8a8_fp8_dot_is_close_to_weight_only():
    """GPUs' path: activations scaled to fp8 per token, fp8 x fp8 dot in float32."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    x = rng.standard_normal((5, 64)).astype(np.float32)
    q, s = quantize(w, "float8_e4m3fn")
    a = np.asarray(qmatmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), (48,),
                           activation_fp8=True))
    b = x @ dequantize(q, s)
    assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()


@pytest.mark.parametrize("hf,match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                 "strategy": "group"}}}}, "num_bits=4"),
])
def test_unsupported_quant_configs_refused_by_name(hf, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig.from_configs(None, hf)


def test_engine_option_checked(tmp_path, smollm2_dir):
    from jaxinfer.config import EngineConfig, resolve_config

    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        resolve_config(EngineConfig(model=smollm2_dir, quantization="awq"))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3fnuz' is not supported"):
        EngineConfig(kv_cache_dtype="fp8_e4m3fnuz")
    with pytest.raises(ValueError, match="quantization=.compressed-tensors. needs a checkpoint quantized"):
        resolve_config(EngineConfig(model=smollm2_dir, quantization="compressed-tensors"))
    rc = resolve_config(EngineConfig(model=smollm2_dir, quantization="int8",
                                     kv_cache_dtype="fp8"))
    assert rc.model_config.quantization.weight_dtype == "int8"
    assert rc.kv_cache_dtype == "float8_e4m3fn"


# -- pre-quantized checkpoints, written here in both formats ----------------------------------

def _quantized_checkpoint(src_dir, dst_dir, fmt):
    """The float checkpoint in src_dir re-written with fp8 decoder projections: HF "fp8"
    (block-wise weight_scale_inv, 32 x 48 blocks: the 64-wide inputs end in a short block)
    or compressed-tensors (per-channel weight_scale); plus k_scale / v_scale. Returns the
    dequantized float32 weights by name."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    out, deq = {}, {}
    bn, bk = 32, 48
    for name, t in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            out[name] = t
            continue
        w = t.float().numpy()  # [out, in]
        o, i = w.shape
        if fmt == "fp8":
            nb, kb = -(-o // bn), -(-i // bk)
            s = np.zeros((nb, kb), np.float32)
            for a in range(nb):
                for b in range(kb):
                    blk = w[a * bn:(a + 1) * bn, b * bk:(b + 1) * bk]
                    s[a, b] = np.abs(blk).max() / 448.0
            full = np.repeat(np.repeat(s, bn, 0)[:o], bk, 1)[:, :i]
            q = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = torch.from_numpy(s)
            deq[name] = q.float().numpy() * full
        else:
            s = np.abs(w).max(axis=1, keepdims=True) / 448.0
            q = torch.from_numpy(w / s).to(torch.float8_e4m3fn)
            out[name + "_scale"] = torch.from_numpy(s.astype(np.float32))
            deq[name] = q.float().numpy() * s
        out[name] = q
    for layer in range(2):
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.05 * (layer + 1))
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.03)
    os.makedirs(dst_dir, exist_ok=True)
    save_file(out, os.path.join(dst_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [bn, bk]}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                "dynamic": False}, "input_activations": {"num_bits": 8, "type": "float",
                                                         "strategy": "token",
                                                         "dynamic": True}}},
            "ignore": ["lm_head"]}
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    for fn in os.listdir(src_dir):
        if fn.startswith("tokenizer"):
            os.link(os.path.join(src_dir, fn), os.path.join(dst_dir, fn))
    return deq


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory, smollm2_dir):
    from tests.engine.conftest import make_tiny_model_dir

    path = tmp_path_factory.mktemp("tiny-float")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=3.0)
    return str(path)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_prequantized_checkpoint_loads_exactly(tmp_path, tiny_float, fmt):
    """The loaded fp8 weights times their scales = the checkpoint's dequantized weights,
    exactly; the KV scales are the checkpoint's; logits = a float model of the dequantized
    weights; the engine runs it (fp8 KV cache, cpu backend) with no leak."""
    from safetensors.torch import load_file, save_file

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.config import ModelConfig
    from jaxinfer.models.loader import load_model
    from tests.engine.conftest import assert_no_leaks

    qdir = str(tmp_path / "q")
    deq = _quantized_checkpoint(tiny_float, qdir, fmt)
    mcfg = ModelConfig.from_pretrained(qdir)
    assert mcfg.quantization.method == fmt and mcfg.quantization.weight_dtype == "float8_e4m3fn"
    import dataclasses

    model, _, _ = load_model(qdir, attention_backend="xla",
                             model_config=dataclasses.replace(mcfg, fp8_kv_cache=True))
    attn = model.model.layers[1].self_attn
    assert float(attn.k_scale[...]) == pytest.approx(0.1) and float(attn.v_scale[...]) == \
        pytest.approx(0.03)
    block = mcfg.quantization.in_block
    mlp = model.model.layers[0].mlp
    w = dequantize(np.asarray(mlp.down_proj.weight[...]), np.asarray(mlp.down_proj.weight_scale[...]),
                   block)
    np.testing.assert_array_equal(w, deq["model.layers.0.mlp.down_proj.weight"].T)
    gu = dequantize(np.asarray(mlp.gate_up_proj.weight[...]).reshape(64, -1),
                    np.asarray(mlp.gate_up_proj.weight_scale[...]).reshape(
                        mlp.gate_up_proj.weight_scale.shape[0], -1), block)
    np.testing.assert_array_equal(gu[:, :128], deq["model.layers.0.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(gu[:, 128:], deq["model.layers.0.mlp.up_proj.weight"].T)

    # A float checkpoint of the dequantized weights gives the same logits.
    fdir = tmp_path / "deq"
    fdir.mkdir()
    tensors = load_file(os.path.join(tiny_float, "model.safetensors"))
    import torch

    for name, value in deq.items():
        tensors[name] = torch.from_numpy(value.astype(np.float32))
    quantized = load_file(os.path.join(qdir, "model.safetensors"))
    for name, value in quantized.items():  # the same KV cache scales
        if name.endswith(("k_scale", "v_scale")):
            tensors[name] = value
    save_file(tensors, str(fdir / "model.safetensors"))
    for fn in os.listdir(tiny_float):
        if fn.endswith(".json"):
            os.link(os.path.join(tiny_float, fn), fdir / fn)
    ref_model, _, _ = load_model(str(fdir), attention_backend="xla")
    ids = jnp.arange(1, 9, dtype=jnp.int32)

    def outputs(m):  # every quantized projection on the same inputs
        h = m.model.embed_tokens(ids)
        outs = []
        for layer in m.model.layers:
            a = layer.self_attn
            outs += list(a.qkv_proj(layer.input_layernorm(h)))
            outs.append(a.o_proj(h))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return outs + [m.compute_logits(m.model.norm(h))]

    for a, b in zip(outputs(model), outputs(ref_model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)

    backend = "cpu" if cpu_kernels.available() else "xla"
    llm = LLM(qdir, kv_cache_dtype="fp8", attention_backend=backend, max_model_len=64,
              num_kv_blocks=16, block_size=16, warmup=False, enable_multiprocessing=False)
    ref = LLM(str(fdir), kv_cache_dtype="fp8", attention_backend=backend, max_model_len=64,
              num_kv_blocks=16, block_size=16, warmup=False, enable_multiprocessing=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [40, 41]}]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_no_leaks(llm)
    stats = llm.llm_engine.get_stats()
    assert stats["weight_bytes_per_device"] < ref.llm_engine.get_stats()["weight_bytes_per_device"]
    llm.shutdown()
    ref.shutdown()


def test_missing_checkpoint_scale_is_named(tmp_path, tiny_float):
    from safetensors.torch import load_file, save_file

    from jaxinfer.models.loader import load_model

    qdir = str(tmp_path / "q")
    _quantized_checkpoint(tiny_float, qdir, "compressed-tensors")
    tensors = load_file(os.path.join(qdir, "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight_scale"]
    save_file(tensors, os.path.join(qdir, "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj.weight'.*is float8_e4m3fn|o_proj.weight_scale"):
        load_model(qdir, attention_backend="xla")


# -- SmolLM2: quantized at load vs float --------------------------------------------------------

def test_smollm2_quantized_at_load_agrees_with_float(smollm2_dir):
    """quantization="int8" / "fp8" (per-channel, at load) and an fp8 KV cache on the real
    model: the greedy first tokens of most prompts equal the float model's; the weights take
    a quarter of the bytes in the linear layers; the fp8 cache holds 4x the blocks."""
    from jaxinfer import LLM, SamplingParams
    from tests.engine.test_llm_greedy import PROMPTS

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    opts = dict(dtype="float32", max_model_len=128, max_num_seqs=16, warmup=False,
                enable_multiprocessing=False, kv_cache_memory_bytes=64 << 20)
    runs = {}
    for name, extra in (("float", {}), ("int8", {"quantization": "int8"}),
                        ("fp8", {"quantization": "fp8", "kv_cache_dtype": "fp8"})):
        llm = LLM(smollm2_dir, **opts, **extra)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs[name] = ([o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats())
        llm.shutdown()
    base, st = runs["float"]
    for name in ("int8", "fp8"):
        toks, s = runs[name]
        first = np.mean([a[0] == b[0] for a, b in zip(toks, base)])
        print(f"{name}: first tokens equal {first:.2f}, all 4 equal "
              f"{np.mean([a == b for a, b in zip(toks, base)]):.2f}")
        assert first >= 0.8, (name, first)
        assert s["weight_bytes_per_device"] < 0.75 * st["weight_bytes_per_device"]
    # the same byte budget: 4x the blocks (floor(4B / b) // 4 == floor(B / b))
    assert (runs["fp8"][1]["num_kv_blocks"] - 1) // 4 == st["num_kv_blocks"] - 1


# -- GGUF kept quantized ------------------------------------------------------------------------

def _random_blocks(name, n_blocks, rng):
    """Random blocks of a GGUF type with sane fp16 scales (random bytes elsewhere)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    d_at = {"Q6_K": [208]}.get(name, [0, 2] if name in ("Q4_1", "Q4_K", "Q5_K") else [0])
    for off in d_at:
        raw[:, off:off + 2] = rng.uniform(0.001, 0.05, n_blocks).astype(np.float16).view(
            np.uint8).reshape(n_blocks, 2)
    return qtype, raw


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("group", [16, 32])
def test_gguf_blocks_dequantize_as_the_gguf_package(name, group):
    """Every kept block type: q * scale + offset per group = gguf's own dequantization."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from jaxinfer.checkpoints.gguf_convert import KEPT_TYPES, gguf_groups

    if group > KEPT_TYPES[name][0]:
        pytest.skip("a Q6_K file uses groups of 16")
    rng = np.random.default_rng(len(name) * group)
    qtype, raw = _random_blocks(name, 12, rng)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 4 * block
    data = raw.reshape(rows, -1)
    ref = np.asarray(gguf_dequantize(data, qtype), np.float32).reshape(rows, cols)
    q, s, m = gguf_groups(data, qtype, (rows, cols), group)
    assert q.dtype == np.int8 and s.shape == m.shape == (rows, cols // group)
    got = dequantize(q.T, s.T, group, m.T).T
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_gguf_types_not_kept_are_refused(smollm2_dir):
    import gguf

    from jaxinfer.checkpoints.gguf_convert import GGUFConversionError, gguf_groups

    with pytest.raises(GGUFConversionError, match="Q2_K cannot be kept quantized"):
        gguf_groups(np.zeros((1, 84), np.uint8), gguf.GGMLQuantizationType.Q2_K, (1, 256), 32)
    from jaxinfer.config import EngineConfig, resolve_config

    with pytest.raises(ValueError, match="quantization='gguf' needs"):
        resolve_config(EngineConfig(model=smollm2_dir, quantization="gguf"))


def test_gguf_file_served_quantized_equals_float(smollm2_dir):
    """LLM(file.gguf, quantization="gguf") keeps the embedded Q4_1 blocks (4-bit codes two to
    a byte on the cpu backend, per-32 scales and offsets: the C++ kernel's groups) and gives the float conversion's
    greedy tokens (the same weights), in under half the weight memory."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.config import EngineConfig, resolve_config
    from jaxinfer.checkpoints.default_model import find_default_gguf
    from tests.engine.test_llm_greedy import PROMPTS

    path = find_default_gguf()
    rc = resolve_config(EngineConfig(model=path, quantization="gguf"))
    assert rc.model_config.quantization.method == "gguf"
    assert rc.model_config.quantization.in_block == 32 and rc.model_dir.endswith("-q")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # (float32 activations: "auto" would run both in bfloat16, whose rounding is not this test's)
    opts = dict(max_model_len=128, max_num_seqs=16, warmup=False, enable_multiprocessing=False,
                dtype="float32")
    runs = {}
    for name, model, extra in (("float", smollm2_dir, {}),
                               ("gguf", path, {"quantization": "gguf"})):
        llm = LLM(model, **opts, **extra)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs[name] = ([o.outputs[0].token_ids for o in outs],
                      llm.llm_engine.get_stats()["weight_bytes_per_device"])
        llm.shutdown()
    same = np.mean([a == b for a, b in zip(runs["gguf"][0], runs["float"][0])])
    print(f"gguf vs float: all 8 tokens equal for {same:.2f} of the prompts")
    assert same >= 0.9, same  # (float rounding order only: the kernel sums per group)
    # the projections' Q4_1 codes two to a byte (+ 0.25 bytes of scale and offset a weight),
    # the tied Q8_0 token_embd a byte a code, held once as the packed LM head (which serves
    # the lookups): 110 of float32's 513 MiB (codes a byte each and a float table: 268)
    assert runs["gguf"][1] < 0.25 * runs["float"][1], runs


# -- quantized routed experts ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason="the C++ kernels could not be built"))])
def test_quantized_experts_equal_the_dense_reference(dtype, packed):
    """int8 / fp8 experts with per-channel scales (the C++ grouped kernel when packed, the
    dequantizing path otherwise) = the dense MoE reference on the dequantized experts."""
    from flax import nnx

    from jaxinfer.layers.moe import SparseMoE, moe_reference

    h, e, i, k = 64, 6, 40, 2
    quant = QuantConfig(method="int8" if dtype == "int8" else "fp8", weight_dtype=dtype,
                        from_checkpoint=False)
    rng = np.random.default_rng(5)
    gu = rng.standard_normal((e, h, 2, i)).astype(np.float32)
    dn = (rng.standard_normal((e, i, h)) * 0.1).astype(np.float32)
    qs = [quantize(w.reshape(w.shape[0], -1), dtype) for w in gu]
    ds = [quantize(w, dtype) for w in dn]
    m = SparseMoE(h, e, k, i, True, dtype=jnp.float32, rngs=nnx.Rngs(0), packed=packed,
                  quant=quant)
    router = rng.standard_normal((h, e)).astype(np.float32) * 0.5
    m.gate.weight.set_value(jnp.asarray(router))
    if packed:
        m.experts.gate_up_proj.set_value(jnp.asarray(np.stack([cpu_kernels.pack(q)
                                                               for q, _ in qs])))
        m.experts.gate_up_proj_scale.set_value(jnp.asarray(np.stack([cpu_kernels.pack(s)
                                                                     for _, s in qs])))
        m.experts.down_proj.set_value(jnp.asarray(np.stack([cpu_kernels.pack(q)
                                                            for q, _ in ds])))
        m.experts.down_proj_scale.set_value(jnp.asarray(np.stack([cpu_kernels.pack(s)
                                                                  for _, s in ds])))
    else:
        m.experts.gate_up_proj.set_value(jnp.asarray(np.stack([q for q, _ in qs]).reshape(
            e, h, 2, i)))
        m.experts.gate_up_proj_scale.set_value(jnp.asarray(np.stack([s for _, s in qs]).reshape(
            e, 1, 2, i)))
        m.experts.down_proj.set_value(jnp.asarray(np.stack([q for q, _ in ds])))
        m.experts.down_proj_scale.set_value(jnp.asarray(np.stack([s for _, s in ds])))
    gu_deq = np.stack([dequantize(q, s) for q, s in qs]).reshape(e, h, 2, i)
    dn_deq = np.stack([dequantize(q, s) for q, s in ds])
    x = jnp.asarray(rng.standard_normal((9, h)).astype(np.float32))
    got = jax.jit(lambda x: m(x))(x)
    ref = moe_reference(x, jnp.asarray(router), jnp.asarray(gu_deq), jnp.asarray(dn_deq), k,
                        True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_qwen3_moe_quantized_at_load_through_the_engine(tmp_path, smollm2_dir):
    """Qwen3-MoE with quantization="fp8": experts and projections fp8 (the loader stacks and
    quantizes each expert: equal to numpy's quantization of the checkpoint tensor)."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.models.loader import load_model
    from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

    make_tiny_model_dir(tmp_path, "qwen3_moe", smollm2_dir, head_dim=16, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    from jaxinfer.config import EngineConfig, resolve_config

    mcfg = resolve_config(EngineConfig(model=str(tmp_path), quantization="fp8")).model_config
    model, _, _ = load_model(str(tmp_path), attention_backend="xla", model_config=mcfg)
    ex = model.model.layers[0].mlp.experts
    assert np.dtype(ex.gate_up_proj.dtype) == np.dtype("float8_e4m3fn")
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    w = tensors["model.layers.0.mlp.experts.2.down_proj.weight"].T  # [I, H]
    q, s = quantize(w, "float8_e4m3fn")
    np.testing.assert_array_equal(np.asarray(ex.down_proj[...][2]).astype(np.float32),
                                  q.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(ex.down_proj_scale[...][2]), s)
    # The engine on both paths (the C++ grouped kernel on packed fp8 experts; XLA on the
    # dequantized experts): the same greedy tokens, no leak.
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [40, 41, 42]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = {}
    for backend in ["xla"] + (["cpu"] if cpu_kernels.available() else []):
        llm = LLM(str(tmp_path), quantization="fp8", attention_backend=backend,
                  dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=16,
                  warmup=False, enable_multiprocessing=False)
        got[backend] = [o.outputs[0].token_ids
                        for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_leaks(llm)
        llm.shutdown()
    assert all(len(t) == 6 for t in got["xla"])
    assert got.get("cpu", got["xla"]) == got["xla"]


def test_w8a8_only_for_fp8_weights_on_gpus():
    """The worker turns fp8 weights into W8A8 on GPUs (with_activation_fp8); int8 weights and
    CPUs stay weight-only."""
    from jaxinfer.layers.quantization import with_activation_fp8

    fp8 = QuantConfig.from_configs("fp8", None)
    int8 = QuantConfig.from_configs("int8", None)
    assert with_activation_fp8(fp8, on_gpu=True).activation_fp8
    assert not with_activation_fp8(fp8, on_gpu=False).activation_fp8
    assert not with_activation_fp8(int8, on_gpu=True).activation_fp8
    assert with_activation_fp8(None, on_gpu=True) is None
