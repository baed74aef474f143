"""DeepSeek-V3's MTP layer as the drafter (speculative_config method "mtp" / "deepseek_mtp"):
its logits equal a torch transcription of vLLM's DeepSeekMultiTokenPredictorLayer
over HF's own decoder layer; greedy outputs equal the target's alone (lossless) through
chunked prefill, preemption and prefix hits; a copying MTP layer on a permutation target gets
every draft accepted; configurations it cannot serve are refused by name."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.engine import resolve_config
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

torch = pytest.importorskip("torch")

H = 64
DEEPSEEK = dict(num_hidden_layers=3, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
                q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
                n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                head_dim=16, tie_word_embeddings=False)


def add_mtp_layer(path, hf, extra: dict) -> None:
    """Make the saved model of L layers an (L - 1)-layer one whose last layer is its MTP
    block: config num_hidden_layers L - 1, num_nextn_predict_layers 1, and the MTP layer's
    own tensors (extra, under model.layers.{L - 1}.) beside the block's."""
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"] - 1
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    fn = os.path.join(path, "model.safetensors")
    tensors = load_file(fn)
    assert any(k.startswith(f"model.layers.{n}.") for k in tensors)
    tensors.update({f"model.layers.{n}.{k}": np.ascontiguousarray(v, np.float32)
                    for k, v in extra.items()})
    save_file(tensors, fn, metadata={"format": "pt"})
    hf.config.num_hidden_layers = n  # (HF's model runs layers[:num_hidden_layers])


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory, smollm2_dir):
    """A random DeepSeek-V3 (a dense layer, then MoE with groups and a shared expert) with a
    random MTP layer (its own embedding copy and head, as DeepSeek-V3's checkpoints have)."""
    path = tmp_path_factory.mktemp("mtp-target")
    hf = make_tiny_model_dir(path, "deepseek_v3", smollm2_dir, sharpen=2.0, **DEEPSEEK)
    rng = np.random.default_rng(7)
    v = hf.config.vocab_size
    extra = {"enorm.weight": 1 + 0.1 * rng.standard_normal(H),
             "hnorm.weight": 1 + 0.1 * rng.standard_normal(H),
             "eh_proj.weight": 0.15 * rng.standard_normal((H, 2 * H)),
             "shared_head.norm.weight": 2 + 0.1 * rng.standard_normal(H),
             "shared_head.head.weight": 0.15 * rng.standard_normal((v, H)),
             "embed_tokens.weight": hf.model.embed_tokens.weight.detach().numpy()}
    add_mtp_layer(path, hf, extra)
    return str(path), hf, extra


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _reference_mtp_logits(hf, extra, ids):
    """At position p the MTP layer reads token p+1 and the target's final normed hidden state
    at p; returns its logits [len(ids) - 1, V] (float32: HF's grouped expert product has no
    float64)."""
    m = hf
    t = {k: torch.tensor(np.asarray(v, np.float32)) for k, v in extra.items()}
    eps = m.config.rms_norm_eps
    with torch.no_grad():
        hidden = m.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
        e = m.model.embed_tokens(torch.tensor(ids[1:]))
        e[0] = 0  # (position 0)
        x = torch.cat([_rms(e, t["enorm.weight"], eps), _rms(hidden, t["hnorm.weight"], eps)],
                      -1) @ t["eh_proj.weight"].T
        n = x.shape[0]
        pos = torch.arange(n)[None]
        pe = m.model.rotary_emb(x[None], pos)
        mask = torch.full((n, n), float("-inf"), dtype=torch.float32).triu(1)[None, None]
        out = m.model.layers[2](x[None], attention_mask=mask, position_ids=pos,
                                position_embeddings=pe)
        out = out[0] if isinstance(out, tuple) else out
        return (_rms(out[0], t["shared_head.norm.weight"], eps)
                @ t["shared_head.head.weight"].T).numpy()


# (xla with the slow tests: the cpu backend is the CPU default and the engine tests' too)
@pytest.mark.parametrize("backend", [pytest.param("xla", marks=pytest.mark.slow), "cpu"])
def test_mtp_logits_equal_the_reference(mtp_target, backend):
    from jaxinfer.layers import cpu_kernels
    from jaxinfer.models.loader import load_model
    from jaxinfer.runner.kv_cache import allocate_kv_caches
    from jaxinfer.runner.step_inputs import empty_step_batch, fill_step_inputs
    from jaxinfer.spec_decode.mtp import load_mtp_head
    from tests.helpers import rel_err

    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip("the C++ kernels could not be built here")
    path, hf, extra = mtp_target
    target, cfg, _ = load_model(path, dtype="float32", attention_backend=backend)
    assert cfg.num_hidden_layers == 2 and cfg.num_nextn_predict_layers == 1
    head = load_mtp_head(path, cfg, dtype="float32", attention_backend=backend)
    assert head.embed_tokens is not None and head.shared_head.head is not None
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 21).tolist()
    n = len(ids) - 1
    token_ids = np.zeros((1, 64), np.int32)
    token_ids[0, :n] = ids[:-1]
    batch = empty_step_batch(n + 3, 2, 16, 1)
    fill_step_inputs(batch, token_ids, np.arange(1, 17, dtype=np.int32)[None],
                     np.array([0], np.int32), np.array([0], np.int32),
                     np.array([n], np.int32), 4)
    md = jax.device_put(batch.attn)
    hidden, _ = target(jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
                       allocate_kv_caches(cfg, 20, 4, jnp.float32), md)
    head_ids = np.zeros_like(batch.input_ids)
    head_ids[:n] = ids[1:]
    kv = allocate_kv_caches(dataclasses.replace(cfg, num_hidden_layers=1), 20, 4, jnp.float32)
    assert kv[0][0].shape[-2:] == (1, 32 + 16)  # the latent cache, as the target's layers
    logit_h, _, _ = head(jnp.asarray(head_ids), jnp.asarray(batch.positions),
                         head.combine(hidden), kv, md, target)
    ours = np.asarray(head.shared_head.head(logit_h))[:n]
    ref = _reference_mtp_logits(hf, extra, ids)
    assert rel_err(ours, ref) < 1e-4


def test_mtp_is_lossless_through_chunks_preemption_and_prefix_hits(mtp_target):
    """Greedy tokens equal HF's for the target alone (the cpu backend; 2 drafts a step)."""
    from tests.engine.conftest import check_family_engine_greedy

    path, hf, _ = mtp_target
    llm = check_family_engine_greedy(path, hf, "cpu", speculative_config={
        "method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert llm.llm_engine.config.speculative_config.method == "mtp"
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert len(stats["spec_decode_num_accepted_tokens_per_pos"]) == 2
    assert_no_leaks(llm)
    llm.shutdown()


def test_copying_mtp_layer_gets_every_draft_accepted(tmp_path, smollm2_dir):
    """A DeepSeek-V3 whose next token is perm[current] (one-hot embeddings, attention and
    expert outputs zeroed, the LM head a permutation) with an MTP layer that passes the
    embedding of the token it reads through (eh_proj = [I, 0], its block's outputs zeroed) and
    shares the target's embedding and LM head: it drafts perm[token], right at every
    position and every depth exactly when it reads token p+1 at position p and then its own
    drafts with its own hidden states. With preemption, chunked prefill and a prefix hit, on
    whole-step programs (the lossless test above runs the layer-wise ones)."""
    n = H
    perm = np.random.default_rng(3).permutation(n)
    hf = make_tiny_model_dir(tmp_path, "deepseek_v3", smollm2_dir,
                             **{**DEEPSEEK, "vocab_size": n})
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(torch.eye(n))
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                for name, p in mlp.experts.named_parameters():
                    if "down" in name:
                        p.zero_()
                mlp.shared_experts.down_proj.weight.zero_()
            else:
                mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        hf.lm_head.weight.copy_(torch.eye(n)[np.argsort(perm)])
    hf.save_pretrained(tmp_path)
    eye = np.eye(n, dtype=np.float32)
    add_mtp_layer(tmp_path, hf, {"enorm.weight": np.ones(n), "hnorm.weight": np.ones(n),
                                  "eh_proj.weight": np.concatenate([eye, 0 * eye], 1),
                                  "shared_head.norm.weight": np.ones(n)})
    rng = np.random.default_rng(0)
    shared = [int(x) for x in rng.integers(0, n, 24)]
    prompts = [[int(x) for x in rng.integers(0, n, 10 + 9 * i)] for i in range(3)]
    prompts += [shared + [1, 2], shared + [3]]
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=96, max_num_seqs=8,
              max_num_batched_tokens=32, block_size=8, num_kv_blocks=15, warmup=False,
              enable_multiprocessing=False, attention_backend="cpu", step_compilation="whole",
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):  # the permutation chain
        toks = [p[-1]] + list(o.outputs[0].token_ids)
        assert len(toks) == 25 and all(int(perm[a]) == b for a, b in zip(toks, toks[1:]))
    st = llm.llm_engine.get_stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    assert st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    head = llm.llm_engine.engine_core.core.worker.eagle_head  # the target's embedding, head
    assert head.embed_tokens is None and head.shared_head.head is None
    assert_no_leaks(llm)
    llm.shutdown()


def _deepseek_config(**changes) -> ModelConfig:
    base = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "num_nextn_predict_layers": 1}
    return ModelConfig.from_hf_dict({**base, **changes})


@pytest.mark.parametrize("changes,match", [
    ({"num_nextn_predict_layers": 0}, "no MTP layer"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers=2"),
])
def test_mtp_targets_without_one_layer_are_refused(changes, match):
    from jaxinfer.spec_decode.mtp import check_mtp_target

    check_mtp_target(_deepseek_config())
    with pytest.raises(ValueError, match=match):
        check_mtp_target(_deepseek_config(**changes))


def test_mtp_config_follows_vllm(smollm2_dir, tmp_path):
    spec = EngineConfig(speculative_config={"method": "deepseek_mtp"}).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.model) == ("mtp", 1, None)
    assert spec.drafts_from_hidden_states and spec.num_lookahead_tokens == 1
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineConfig(speculative_config={"method": "mtp", "model": "/nonexistent"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 0})
    # A target without MTP layers (SmolLM2, a Llama) is refused where the engine resolves it.
    with pytest.raises(ValueError, match="multi-token prediction"):
        resolve_config(EngineConfig(model=smollm2_dir, speculative_config={"method": "mtp"}))
