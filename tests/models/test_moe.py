"""Mixture of experts: the grouped expert computation (ragged_dot and the C++ grouped kernel)
against the dense reference, router edge cases, Qwen3-MoE and Mixtral greedy tokens against HF
through chunked prefill, prefix caching and preemption, and bad configs refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.layers import cpu_kernels
from jaxinfer.layers.moe import SparseMoE, moe_reference, route

H, I, E = 32, 40, 6


def _moe(top_k=2, norm=True, packed=False, seed=0):
    m = SparseMoE(H, E, top_k, I, norm, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    # Decisive, varied routing: router weights far larger than the init's.
    m.gate.weight.set_value(jax.random.normal(jax.random.key(seed + 7), (H, E)) * 0.5)
    m.experts.gate_up_proj.set_value(jax.random.normal(jax.random.key(seed + 8), (E, H, 2, I)))
    m.experts.down_proj.set_value(jax.random.normal(jax.random.key(seed + 9), (E, I, H)) * 0.1)
    if not packed:
        return m
    p = SparseMoE(H, E, top_k, I, norm, dtype=jnp.float32, rngs=nnx.Rngs(seed), packed=True)
    p.gate.weight.set_value(m.gate.weight[...])
    gu, dn = np.asarray(m.experts.gate_up_proj[...]), np.asarray(m.experts.down_proj[...])
    p.experts.gate_up_proj.set_value(jnp.asarray(
        np.stack([cpu_kernels.pack(w.reshape(H, -1)) for w in gu])))
    p.experts.down_proj.set_value(jnp.asarray(np.stack([cpu_kernels.pack(w) for w in dn])))
    return p, m


def _reference(m, x, top_k, norm):
    return moe_reference(x, m.gate.weight[...], m.experts.gate_up_proj[...],
                         m.experts.down_proj[...], top_k, norm)


PACKED = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason="the C++ kernels could not be built here"))]


@pytest.mark.parametrize("packed", PACKED)
@pytest.mark.parametrize("top_k,norm,tokens", [(2, True, 9), (1, False, 5), (E, False, 7),
                                               (3, True, 1)])
def test_grouped_experts_equal_the_dense_reference(packed, top_k, norm, tokens):
    built = _moe(top_k, norm, packed)
    m, ref_m = built if packed else (built, built)
    x = jax.random.normal(jax.random.key(tokens), (tokens, H))
    got = jax.jit(lambda x: m(x))(x)
    ref = _reference(ref_m, x, top_k, norm)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("packed", PACKED)
def test_router_edge_cases_all_to_one_expert_and_idle_experts(packed):
    """Every token to expert 3 (the others get no rows; E-1 groups empty), and a batch where
    one expert has every slot but one: the grouped path equals the per-token sum."""
    built = _moe(2, True, packed)
    m, ref_m = built if packed else (built, built)
    x = jax.random.normal(jax.random.key(0), (8, H))
    gu, dn = ref_m.experts.gate_up_proj[...], ref_m.experts.down_proj[...]

    def by_hand(ids, w):
        out = []
        for t in range(x.shape[0]):
            acc = 0
            for j in range(ids.shape[1]):
                g = jnp.einsum("h,hgi->gi", x[t], gu[ids[t, j]])  # [2, I]
                acc = acc + w[t, j] * ((jax.nn.silu(g[0]) * g[1]) @ dn[ids[t, j]])
            out.append(acc)
        return np.stack(out)

    w = jnp.full((8, 2), 0.5, jnp.float32)
    for ids in (np.full((8, 2), 3, np.int32),
                np.array([[5, 0]] + [[5, 5]] * 7, np.int32)):
        got = jax.jit(lambda x, w, i: m.experts(x, w, i))(x, w, jnp.asarray(ids))
        np.testing.assert_allclose(np.asarray(got), by_hand(ids, w), rtol=2e-5, atol=2e-5)


def test_route_softmax_topk_and_renormalisation():
    logits = jnp.array([[0.0, 2.0, 1.0, -1.0]])
    w, ids = route(logits, 2, False)
    p = np.exp([0.0, 2.0, 1.0, -1.0]) / np.exp([0.0, 2.0, 1.0, -1.0]).sum()
    assert ids.tolist() == [[1, 2]] and ids.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(w)[0], p[[1, 2]], rtol=1e-6)
    w, _ = route(logits, 2, True)
    np.testing.assert_allclose(np.asarray(w)[0], p[[1, 2]] / p[[1, 2]].sum(), rtol=1e-6)


MOE_BASE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 24, "moe_intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4,
            "num_experts_per_tok": 2, "head_dim": 8}


def _moe_block(cfg) -> str:
    """The attribute (= checkpoint name) of the MoE block in the family's model (layer 1)."""
    from flax import nnx

    from jaxinfer.models.registry import get_model_class

    model = nnx.eval_shape(lambda: get_model_class(cfg.architecture)(cfg, rngs=nnx.Rngs(0)))
    return model.model.layers[1].ffn_name


def test_moe_config_fields_and_layer_pattern():
    cfg = ModelConfig.from_hf_dict({**MOE_BASE, "mlp_only_layers": [0], "norm_topk_prob": True})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 8)
    assert cfg.norm_topk_prob and cfg.qk_norm and _moe_block(cfg) == "mlp"
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
    cfg = ModelConfig.from_hf_dict({**MOE_BASE, "decoder_sparse_step": 2})
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
    mix = ModelConfig.from_hf_dict({**MOE_BASE, "architectures": ["MixtralForCausalLM"],
                                    "num_experts": None, "num_local_experts": 8})
    # Mixtral: experts are intermediate_size wide, the top-2 always renormalised.
    assert (mix.num_experts, mix.moe_intermediate_size, mix.norm_topk_prob) == (8, 24, True)
    assert _moe_block(mix) == "block_sparse_moe" and not mix.qk_norm


@pytest.mark.parametrize("change,match", [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be between 1 and num_experts=4"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0"),
    ({"num_experts": None}, r"no num_experts"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size=64: shared "
                                              r"experts are only supported for Qwen2Moe"),
    ({"n_shared_experts": 2}, r"n_shared_experts=2: DeepSeek-style"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step must be >= 1"),
])
def test_bad_moe_configs_are_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**MOE_BASE, **change})


def test_tp_must_divide_the_expert_width():
    from jaxinfer.parallel import tp_model_config

    cfg = ModelConfig.from_hf_dict({**MOE_BASE, "moe_intermediate_size": 6,
                                    "num_attention_heads": 4, "num_experts": 6})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide "
                                         r"moe_intermediate_size=6"):
        tp_model_config(cfg, 4)
    assert not tp_model_config(cfg, 2)[0].expert_parallel  # 6 splits over 2
    # Expert parallelism splits the experts, not their width: E must divide instead.
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size=4 "
                                         r"must divide num_experts=6"):
        tp_model_config(cfg, 4, expert_parallel=True)
    ep, _ = tp_model_config(cfg, 2, expert_parallel=True)
    assert ep.expert_parallel and not cfg.expert_parallel
    assert tp_model_config(cfg, 1, expert_parallel=True)[0] is cfg  # one device: nothing to split


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file

    from jaxinfer.models.loader import load_model

    cfg = {**MOE_BASE, "num_hidden_layers": 1, "tie_word_embeddings": True}
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    p = "model.layers.0."
    t = {"model.embed_tokens.weight": z(32, 16), "model.norm.weight": z(16),
         p + "input_layernorm.weight": z(16), p + "post_attention_layernorm.weight": z(16),
         p + "self_attn.q_proj.weight": z(16, 16), p + "self_attn.k_proj.weight": z(8, 16),
         p + "self_attn.v_proj.weight": z(8, 16), p + "self_attn.o_proj.weight": z(16, 16),
         p + "self_attn.q_norm.weight": z(8), p + "self_attn.k_norm.weight": z(8),
         p + "mlp.gate.weight": z(4, 16)}
    for e in range(4):
        t.update({f"{p}mlp.experts.{e}.gate_proj.weight": z(8, 16),
                  f"{p}mlp.experts.{e}.up_proj.weight": z(8, 16),
                  f"{p}mlp.experts.{e}.down_proj.weight": z(16, 8)})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(tmp_path / "model.safetensors"))
    model, mcfg, _ = load_model(str(tmp_path))
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 16, 2, 8)
    del t[f"{p}mlp.experts.2.up_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.mlp\.experts\.2\."
                                         r"up_proj\.weight'"):
        load_model(str(tmp_path))
    t[f"{p}mlp.experts.2.up_proj.weight"] = z(9, 16)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight.*\(16, 9\).*\(16, 8\)"):
        load_model(str(tmp_path))


SYNC = {"async_scheduling": False}


@pytest.mark.parametrize("arch,extra,engine", [
    ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 48, "norm_topk_prob": False,
                   "mlp_only_layers": [1]}, SYNC),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
     SYNC),
    ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48}, SYNC),
    # Gemma 3 (not MoE; the same path): a sliding window shorter than most prompts.
    ("gemma3", {"head_dim": 16, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]}, SYNC),
    # MoE with async scheduling (the default), and with n-gram speculative decoding
    ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 48}, {}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                             "prompt_lookup_min": 1, "prompt_lookup_max": 2}}),
])
def test_greedy_matches_hf_through_chunks_prefix_hits_and_preemption(tmp_path, smollm2_dir,
                                                                     arch, extra, engine):
    pytest.importorskip("torch")
    from jaxinfer import LLM, SamplingParams
    from tests.engine.conftest import assert_no_leaks, hf_greedy, make_tiny_model_dir
    from tests.engine.test_llm_greedy import PROMPTS

    hf = make_tiny_model_dir(tmp_path, arch, smollm2_dir, **extra)
    # 16-token chunks over 8-token blocks; 7 usable blocks for 4 sequences of up to ~30 tokens:
    # preemption; the prompts run twice: prefix-cache hits.
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=48, max_num_seqs=4,
              max_num_batched_tokens=16, warmup=False, num_kv_blocks=8, block_size=8,
              long_prefill_token_threshold=8, **engine)
    tok = llm.get_tokenizer()
    prompts = PROMPTS[:6]
    refs = [hf_greedy(hf, tok(p)["input_ids"], 10) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0, stats
    if engine == SYNC:  # (7 blocks thrash under LRU: hits depend on the order blocks free
        assert stats["prefix_cache_hits"] > 0, stats  # in; async scheduling's order had none)
    if "speculative_config" in engine:
        assert stats["spec_decode_num_draft_tokens"] > 0, stats
    assert_no_leaks(llm)
    llm.shutdown()


def test_roofline_counts_active_parameters():
    """`bench roofline` on a MoE config: FLOPs from the k experts a token runs, weight bytes
    from the experts a batch touches; a dense config of the same active size agrees."""
    from jaxinfer.bench.roofline import (decode_step_flops, decode_step_floor_s, experts_touched,
                                         param_count)

    cfg = ModelConfig.from_hf_dict({**MOE_BASE, "num_experts": 8, "num_experts_per_tok": 2,
                                    "mlp_only_layers": [1]})
    dense = ModelConfig.from_hf_dict({**MOE_BASE, "architectures": ["Qwen3ForCausalLM"],
                                      "intermediate_size": 16})  # 2 experts x 8 wide
    p, d = param_count(cfg), param_count(dense)
    h, expert = 16, 3 * 16 * 8
    assert p["expert"] == expert and p["moe_layers"] == 1
    # layer 0: 8 experts + router (active: 2 + router); layer 1: the dense MLP (24 wide)
    assert p["layers"] - p["active_layers"] == 6 * expert
    assert p["active_layers"] == d["layers"] + h * 8 + 3 * h * (24 - 16)
    assert decode_step_flops(cfg, 4, 10) - decode_step_flops(dense, 4, 10) == \
        2 * 4 * (h * 8 + 3 * h * 8)
    assert experts_touched(cfg, 1) == pytest.approx(2) and experts_touched(cfg, 1000) == \
        pytest.approx(8)
    # Batch 1 reads 2 of the 8 experts' weights; a large batch all 8.
    small, big = (decode_step_floor_s(cfg, 4, b, 0, 1.0) for b in (1, 1000))
    assert big - small == pytest.approx(4 * 6 * expert)
