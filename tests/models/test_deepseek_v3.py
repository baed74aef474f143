"""DeepSeek-V3 (DeepseekV3ForCausalLM): config fields and refusals, the group-limited sigmoid
router against HF's, the latent KV cache's size (bytes counted), absorbed attention against
the expanded form, and the engine's greedy tokens against HF float32 through chunked prefill,
prefix-cache hits and preemption. (Prefill / decode logits against HF:
tests/models/test_hf_parity.py, the "deepseek-v3" configs.)"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 160, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
        "n_routed_experts": 8, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
        "v_head_dim": 24, "qk_nope_head_dim": 32, "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
        "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}


def test_config_fields():
    cfg = ModelConfig.from_hf_dict(BASE)
    # The cache: one "KV head" as wide as the latent plus the rope key, no V cache.
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.v_cache_dim) == (1, 48, 0)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim) == (32, 48, 32, 16, 24)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (cfg.moe_scoring, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
            cfg.n_shared_experts, cfg.rope_interleave) == ("sigmoid", 4, 2, 2.5, 1, True)


@pytest.mark.parametrize("change,match", [
    ({"n_group": 3}, "n_group=3 must divide"),
    ({"topk_group": 5}, "topk_group=5 must be between"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
])
def test_config_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, **change})


def test_other_families_still_refuse_shared_experts_and_dense_layers():
    qwen = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}
    with pytest.raises(ValueError, match="n_shared_experts=1"):
        ModelConfig.from_hf_dict(qwen)


def test_router_equals_hf():
    import jax.numpy as jnp

    from jaxinfer.models.deepseek_v3 import grouped_sigmoid_route

    hf_cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, n_group=4,
                                           topk_group=2, num_experts_per_tok=4,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(hf_cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(40, 16)
    with torch.no_grad():
        logits, w_ref, ids_ref = router(x)
    w, ids = grouped_sigmoid_route(jnp.asarray(logits.numpy()),
                                   jnp.asarray(router.e_score_correction_bias.numpy()), 4, 4, 2,
                                   True)
    order_ref, order = np.argsort(ids_ref.numpy(), 1), np.argsort(np.asarray(ids), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1),
                                  np.take_along_axis(ids_ref.numpy(), order_ref, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1) * 2.5,
                               np.take_along_axis(w_ref.numpy(), order_ref, 1), rtol=1e-6)
    # The groups matter: some token's best experts overall lie outside its two best groups.
    plain = np.argsort(-(torch.sigmoid(logits) + router.e_score_correction_bias).numpy(), 1)
    assert any(set(plain[i, :4]) != set(np.asarray(ids)[i]) for i in range(40))


def test_latent_cache_holds_the_latent_width_per_token():
    """Bytes per token per layer: (kv_lora_rank + qk_rope_head_dim) x itemsize, against
    2 x heads x (qk_nope + qk_rope) x itemsize for the same model's full K/V."""
    from jaxinfer.runner.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block

    cfg = ModelConfig.from_hf_dict(BASE)
    caches = allocate_kv_caches(cfg, 5, 16, "float32")
    assert len(caches) == 3
    k, v = caches[0]
    assert k.shape == (5, 16, 1, 48) and v.shape == (5, 16, 1, 0)
    per_token_layer = (k.nbytes + v.nbytes) // (5 * 16)
    assert per_token_layer == (32 + 16) * 4
    assert kv_cache_bytes_per_block(cfg, 16, "float32") == 16 * 3 * per_token_layer
    full = 2 * 4 * (32 + 16) * 4
    assert full / per_token_layer == 8.0


def test_absorbed_attention_equals_the_expanded_form():
    """The layer's absorbed attention over the latent cache equals per-head K/V expanded
    from it (HF's form), with jnp: causal, several sequences."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.models.deepseek_v3 import MLAttention

    cfg = ModelConfig.from_hf_dict({**BASE, "num_hidden_layers": 1, "first_k_dense_replace": 1})
    attn = MLAttention(cfg, dtype=jnp.float32, attention_backend="xla", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for name, var in nnx.to_flat_state(nnx.state(attn)):
        var.set_value(jnp.asarray(rng.normal(0, 0.2, var.value.shape), jnp.float32))
    t = 9
    x = jnp.asarray(rng.normal(0, 1, (t, 64)), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)
    from jaxinfer.layers.attention import AttentionMetadata
    from jaxinfer.layers.rotary import apply_rotary, rope_tables

    cos, sin = rope_tables(pos, 16, 1e4, cfg.rope_scaling)
    cache = (jnp.zeros((2, 16, 1, 48)), jnp.zeros((2, 16, 1, 0)))
    md = AttentionMetadata(slot_mapping=16 + pos, block_tables=jnp.array([[1]], jnp.int32),
                           seq_lens=jnp.array([t], jnp.int32),
                           query_start_loc=jnp.array([0, t], jnp.int32),
                           num_seqs=jnp.array([1], jnp.int32),
                           num_decodes=jnp.array([0], jnp.int32))
    out, _ = attn(x, cos, sin, cache, md)

    # Expanded: q, k, v per head; plain causal softmax attention.
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).reshape(t, 4, 48)
    ckv = attn.kv_a_proj_with_mqa(x)
    c = attn.kv_a_layernorm(ckv[:, :32])
    k_nope = jnp.einsum("tl,hnl->thn", c, attn.w_uk[...])  # (kv_b_proj's per-head parts)
    v = jnp.einsum("tl,hlv->thv", c, attn.w_uv[...])
    q_pe = q[..., 32:]
    k_pe = ckv[:, None, 32:]
    deint = (lambda a: jnp.concatenate([a[..., 0::2], a[..., 1::2]], -1))  # noqa: E731
    q_pe, k_pe = apply_rotary(deint(q_pe), cos, sin), apply_rotary(deint(k_pe), cos, sin)
    qf = jnp.concatenate([q[..., :32], q_pe], -1)
    kf = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (t, 4, 16))], -1)
    s = jnp.einsum("thd,shd->hts", qf, kf) * attn.sm_scale
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None], s, -jnp.inf)
    o = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, -1), v).reshape(t, 96)
    np.testing.assert_allclose(np.asarray(out), np.asarray(attn.o_proj(o)), rtol=2e-5,
                               atol=2e-5)


def _tiny_deepseek(path, smollm2_dir):
    """A random 3-layer DeepSeek-V3 with SmolLM2's tokenizer: a dense first layer, MoE layers
    with 4 groups (2 compete) and a shared expert, latent attention with a q LoRA."""
    from tests.engine.conftest import make_tiny_model_dir

    return make_tiny_model_dir(
        path, "deepseek_v3", smollm2_dir, num_hidden_layers=3, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, head_dim=16, tie_word_embeddings=False)


# (xla with the slow tests: CI keeps the CPU default backend, and xla's logits parity)
@pytest.mark.parametrize("backend", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_engine_greedy_equals_hf_through_chunks_prefix_hits_and_preemption(
        tmp_path, smollm2_dir, backend):
    from tests.engine.conftest import check_family_engine_greedy

    llm = check_family_engine_greedy(tmp_path, _tiny_deepseek(tmp_path, smollm2_dir), backend)
    caches = llm.llm_engine.engine_core.core.worker.runner.kv_caches
    assert caches[0][0].shape[2:] == (1, 32 + 16) and caches[0][1].shape[-1] == 0
    llm.shutdown()


@pytest.mark.parametrize("backend", ["pallas", "cpu", "xla"])
def test_latent_attention_on_each_backend_equals_the_reference(backend):
    """paged_latent_attention (the cache as keys and values) on the Pallas kernel
    (interpret mode), the C++ kernel and xla, against the jnp reference; decodes and a
    prefill chunk on cached context, 16-token pages."""
    import jax.numpy as jnp

    from jaxinfer.layers import cpu_kernels
    from jaxinfer.layers.attention import AttentionMetadata, paged_latent_attention

    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip("the C++ kernels could not be built here")
    rng = np.random.default_rng(3)
    q_lens, ctx = [1, 1, 7], [20, 3, 18]
    t, width = sum(q_lens), 48
    cache = jnp.asarray(rng.normal(0, 1, (8, 16, 1, width)), jnp.float32)
    tables = jnp.asarray([[1, 2], [3, 0], [4, 5]], jnp.int32)
    slots, qsl = [], [0]
    for s, (n, c) in enumerate(zip(q_lens, ctx)):
        for p in range(c, c + n):
            slots.append(int(tables[s, p // 16]) * 16 + p % 16)
        qsl.append(qsl[-1] + n)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=tables,
                           seq_lens=jnp.asarray([n + c for n, c in zip(q_lens, ctx)],
                                                jnp.int32),
                           query_start_loc=jnp.asarray(qsl, jnp.int32),
                           num_seqs=jnp.asarray([3], jnp.int32),
                           num_decodes=jnp.asarray([2], jnp.int32))
    q = jnp.asarray(rng.normal(0, 1, (t, 4, width)), jnp.float32)
    latent = jnp.asarray(rng.normal(0, 1, (t, 1, width)), jnp.float32)
    ref, ref_cache = paged_latent_attention(q, latent, cache, md, sm_scale=0.1,
                                            backend="reference")
    out, new_cache = paged_latent_attention(q, latent, cache, md, sm_scale=0.1,
                                            backend=backend)
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(ref_cache))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_pallas_kernel_lowers_for_cuda_at_deepseek_v3_shapes():
    """The latent cache as one 576-wide KV head (512 + 64) under 16 and 128 query heads."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="cuda"))
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for hq in (16, 128):
        args = (S((64, hq, 576), bf), S((64, 16, 1, 576), bf), S((64, 16, 1, 576), bf),
                S((64,), jnp.int32), S((64, 32), jnp.int32), S((65,), jnp.int32),
                S((1,), jnp.int32))
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1)).trace(
                *args).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("method,groups", [("greedy", 1), ("group_limited_greedy", 4)])
def test_v2_router_equals_hf(method, groups):
    """DeepSeek-V2's softmax router (no correction bias; V2's configs leave norm_topk_prob
    off, and HF's V2 never renormalises)."""
    import jax.numpy as jnp

    from jaxinfer.models.deepseek_v3 import grouped_softmax_route

    hf_cfg = transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4,
                                           n_routed_experts=16, n_group=groups,
                                           topk_group=2 if groups > 1 else 1,
                                           num_experts_per_tok=4, topk_method=method,
                                           routed_scaling_factor=1.5)
    router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(hf_cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    x = torch.randn(40, 16)
    with torch.no_grad():
        logits, w_ref, ids_ref = router(x)
    w, ids = grouped_softmax_route(jnp.asarray(logits.numpy()), 4, groups,
                                   2 if groups > 1 else 1, False)
    order_ref, order = np.argsort(ids_ref.numpy(), 1), np.argsort(np.asarray(ids), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1),
                                  np.take_along_axis(ids_ref.numpy(), order_ref, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1) * 1.5,
                               np.take_along_axis(w_ref.numpy(), order_ref, 1), rtol=1e-6)


def test_v2_config_fields():
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["DeepseekV2ForCausalLM"],
                                    "topk_method": "greedy", "q_lora_rank": None})
    assert (cfg.moe_scoring, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
            cfg.rope_interleave, cfg.q_lora_rank) == ("softmax", 1, 1, False, True, None)
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["DeepseekV2ForCausalLM"],
                                  "topk_method": "noaux_tc"})
