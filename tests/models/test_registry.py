"""Adding a model family takes one model file and one registry row: a toy family
(toy_family.py) registered here is loaded from an HF-style checkpoint, served by LLM with its
greedy tokens equal to a float64 numpy forward of the same weights, and its own parameters
are sharded by their declarations alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer.models.registry import get_model_class, register_model, supported_architectures

CFG = dict(architectures=["ToyForCausalLM"], model_type="toy", vocab_size=96, hidden_size=32,
           intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
           rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
           torch_dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    register_model("ToyForCausalLM", "tests.models.toy_family", "ToyForCausalLM")  # the row


def _weights(rng) -> dict[str, np.ndarray]:
    h, i, v, d = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"], 8
    hq, hkv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    w = {"model.embed_tokens.weight": rng.normal(0, 0.5, (v, h)),
         "model.norm.weight": 1 + rng.normal(0, 0.1, h), "lm_head.weight": rng.normal(0, 0.3, (v, h))}
    for n in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({p + "input_layernorm.weight": 1 + rng.normal(0, 0.1, h),
                  p + "post_attention_layernorm.weight": 1 + rng.normal(0, 0.1, h),
                  p + "self_attn.q_proj.weight": rng.normal(0, 0.3, (hq * d, h)),
                  p + "self_attn.k_proj.weight": rng.normal(0, 0.3, (hkv * d, h)),
                  p + "self_attn.v_proj.weight": rng.normal(0, 0.3, (hkv * d, h)),
                  p + "self_attn.o_proj.weight": rng.normal(0, 0.3, (h, hq * d)),
                  p + "mlp.up.weight": rng.normal(0, 0.3, (i, h)),
                  p + "mlp.down.weight": rng.normal(0, 0.3, (h, i))})
    return {k: a.astype(np.float32) for k, a in w.items()}


def _reference_greedy(w, ids: list[int], n: int) -> list[int]:
    """The toy's forward in float64 numpy, recomputed over the whole sequence per token."""
    hq, hkv, d = CFG["num_attention_heads"], CFG["num_key_value_heads"], 8
    w = {k: a.astype(np.float64) for k, a in w.items()}

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG["rms_norm_eps"]) * g

    def rope(x, pos):  # [T, H, D], rotate-half
        inv = 1.0 / CFG["rope_theta"] ** (np.arange(0, d, 2) / d)
        f = pos[:, None] * inv[None]
        c, s = np.cos(f)[:, None], np.sin(f)[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    out = list(ids)
    for _ in range(n):
        t = len(out)
        pos = np.arange(t, dtype=np.float64)
        x = w["model.embed_tokens.weight"][out]
        for layer in range(CFG["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            a = rms(x, w[p + "input_layernorm.weight"])
            q = rope((a @ w[p + "self_attn.q_proj.weight"].T).reshape(t, hq, d), pos)
            k = rope((a @ w[p + "self_attn.k_proj.weight"].T).reshape(t, hkv, d), pos)
            v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(t, hkv, d)
            k, v = np.repeat(k, hq // hkv, 1), np.repeat(v, hq // hkv, 1)
            s = np.einsum("thd,uhd->htu", q, k) / np.sqrt(d)
            s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("htu,uhd->thd", pr, v).reshape(t, hq * d)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            m = rms(x, w[p + "post_attention_layernorm.weight"])
            x = x + (np.maximum(m @ w[p + "mlp.up.weight"].T, 0) ** 2) @ w[p + "mlp.down.weight"].T
        logits = rms(x, w["model.norm.weight"])[-1] @ w["lm_head.weight"].T
        out.append(int(np.argmax(logits)))
    return out[len(ids):]


def test_a_toy_family_is_one_file_and_one_registry_row(tmp_path):
    from safetensors.numpy import save_file

    from jaxinfer import LLM, SamplingParams

    assert "ToyForCausalLM" in supported_architectures()
    assert get_model_class("ToyForCausalLM").__name__ == "ToyForCausalLM"
    w = _weights(np.random.default_rng(0))
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    save_file(w, str(tmp_path / "model.safetensors"))
    # (in this process: the registry row is this process's)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16, num_kv_blocks=24, block_size=16, warmup=False,
              skip_tokenizer_init=True, enable_multiprocessing=False)
    prompts = [[5, 17, 33, 2, 60], [9] * 19, [40, 41]]  # one longer than a step's budget
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == _reference_greedy(w, p, 8), p
    llm.shutdown()


def test_the_toy_parameters_shard_by_their_declarations():
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jaxinfer.config import ModelConfig
    from jaxinfer.parallel import param_spec

    cfg = ModelConfig.from_hf_dict(CFG)
    model = nnx.eval_shape(lambda: get_model_class(cfg.architecture)(cfg, rngs=nnx.Rngs(0)))
    mlp = model.model.layers[0].mlp
    assert param_spec(mlp.up.weight, 2) == P(None, "tp")  # column-parallel
    assert param_spec(mlp.down.weight, 2) == P("tp", None)  # row-parallel
    assert param_spec(model.lm_head.weight, 2) == P(None, "tp")  # vocab-parallel
    assert param_spec(mlp.up.weight, 1) == P()
