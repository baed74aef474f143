"""Pooling models (runner="pooling"): embeddings equal HF transformers in float64 (LAST, MEAN,
CLS pooling, normalized), through chunked prefill, the engine core in its own process, async
scheduling, a KV cache too small for the batch, and a bare Qwen3Model checkpoint; Matryoshka
dimensions; refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from jaxinfer import LLM  # noqa: E402
from jaxinfer.pooling import PoolingParams  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 17, 1)]
BASE = dict(runner="pooling", dtype="float32", skip_tokenizer_init=True, max_model_len=128,
            max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, warmup=False)


def _config(**extra):
    return T.Qwen3Config(vocab_size=160, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, **extra)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random Qwen3ForCausalLM folder, a bare Qwen3Model folder of the same weights, and
    the float64 reference decoder."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():  # (norm weights away from 1, so that they matter)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    causal = str(tmp_path_factory.mktemp("qwen3-causal"))
    model.save_pretrained(causal)
    bare = str(tmp_path_factory.mktemp("qwen3-bare"))
    model.model.save_pretrained(bare)  # architectures ["Qwen3Model"], no "model." prefix
    return causal, bare, model.model.double()


def _reference(decoder, prompt, kind):
    with torch.no_grad():
        h = decoder(torch.tensor([prompt])).last_hidden_state[0].numpy()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return v / np.linalg.norm(v)


def _check(outs, decoder, kind, prompts=PROMPTS):
    for prompt, out in zip(prompts, outs):
        e = np.asarray(out.outputs.embedding, np.float64)
        assert e.shape == (64,) and abs(np.linalg.norm(e) - 1) < 1e-5
        assert float(e @ _reference(decoder, prompt, kind)) > 0.99999, (kind, len(prompt))
        assert out.prompt_token_ids == prompt


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_hf_through_chunked_prefill(qwen3, kind):
    causal, _, decoder = qwen3
    llm = LLM(causal, enable_multiprocessing=False, pooler_config={"pooling_type": kind},
              **BASE)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        _check(llm.embed(prompts, use_tqdm=False), decoder, kind)
        # the same batch again: LAST may hit the prefix cache, MEAN / CLS run without one
        again = llm.embed(prompts, use_tqdm=False)
        _check(again, decoder, kind)
        stats = llm.llm_engine.get_stats()
        assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1  # (no leaked block)
        assert (llm.llm_engine.resolved.cache.enable_prefix_caching) == (kind == "LAST")
    finally:
        llm.shutdown()


def test_bare_checkpoint_core_process_async_and_preemption(qwen3):
    """Qwen3Model weights (no prefix, no LM head) are a pooling model by default; the core in
    its own process with async scheduling and a KV cache that holds only some requests."""
    _, bare, decoder = qwen3
    with open(os.path.join(bare, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3Model"]
    opts = dict(BASE, runner="auto", num_kv_blocks=9, block_size=16, max_num_batched_tokens=64,
                async_scheduling=True)
    llm = LLM(bare, enable_multiprocessing=True, **opts)
    try:
        assert llm.llm_engine.resolved.runner == "pooling"
        prompts = [list(range(10 + i, 10 + i + 30 + 3 * i)) for i in range(6)]
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        _check(outs, decoder, "LAST", prompts)
        stats = llm.llm_engine.get_stats()  # (a KV cache of 8 blocks: requests waited)
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1
        scores = llm.score({"prompt_token_ids": prompts[0]},
                           [{"prompt_token_ids": p} for p in prompts[:3]], use_tqdm=False)
        assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
        e = [np.asarray(o.outputs.embedding) for o in outs[:3]]
        assert [s.outputs.score for s in scores] == pytest.approx(
            [float(e[0] @ x) for x in e], abs=1e-5)
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate([{"prompt_token_ids": [1, 2]}])
    finally:
        llm.shutdown()


def test_matryoshka_dimensions_and_pooling_params(tmp_path, qwen3):
    causal, _, decoder = qwen3
    with open(os.path.join(causal, "config.json")) as f:
        cfg = json.load(f)
    m = str(tmp_path / "matryoshka")
    os.makedirs(m)
    for name in os.listdir(causal):
        if name != "config.json":
            os.symlink(os.path.join(causal, name), os.path.join(m, name))
    with open(os.path.join(m, "config.json"), "w") as f:
        json.dump(dict(cfg, matryoshka_dimensions=[16, 32, 64]), f)
    llm = LLM(m, enable_multiprocessing=False, **BASE)
    try:
        prompt = {"prompt_token_ids": PROMPTS[1]}
        full = np.asarray(llm.embed(prompt, use_tqdm=False)[0].outputs.embedding)
        (short,) = llm.embed(prompt, PoolingParams(dimensions=32), use_tqdm=False)
        want = full[:32] / np.linalg.norm(full[:32])
        np.testing.assert_allclose(short.outputs.embedding, want, atol=1e-6)
        (raw,) = llm.encode(prompt, PoolingParams(normalize=False), use_tqdm=False)
        with torch.no_grad():
            h = decoder(torch.tensor([PROMPTS[1]])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(raw.outputs.data, h, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="matryoshka_dimensions"):
            llm.embed(prompt, PoolingParams(dimensions=24), use_tqdm=False)
    finally:
        llm.shutdown()
    llm = LLM(causal, enable_multiprocessing=False, **BASE)
    try:
        with pytest.raises(ValueError, match="matryoshka"):
            llm.embed({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=32),
                      use_tqdm=False)
    finally:
        llm.shutdown()


def test_pooling_options_refused_by_name(qwen3):
    causal, _, _ = qwen3
    for kwargs, needle in (({"pooler_config": {"pooling_type": "MAX"}}, "pooling_type"),
                           ({"pooler_config": {"frobnicate": 1}}, "frobnicate"),
                           ({"runner": "embed"}, "runner"),
                           ({"task": "classify"}, "task"),
                           ({"speculative_config": {"method": "ngram",
                                                    "num_speculative_tokens": 2}},
                            "speculative_config")):
        with pytest.raises(ValueError, match=needle):
            LLM(causal, **dict(BASE, **kwargs))
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(causal, **dict(BASE, runner="generate", pooler_config={"pooling_type": "MEAN"}))
    llm = LLM(causal, enable_multiprocessing=False, **dict(BASE, runner="generate"))
    try:
        with pytest.raises(ValueError, match="pooling model"):
            llm.embed({"prompt_token_ids": [1, 2]}, use_tqdm=False)
    finally:
        llm.shutdown()


def test_sentence_transformers_folder_sets_the_pooler(tmp_path, qwen3):
    """modules.json with a Pooling module (mean tokens) and no Normalize: MEAN, unnormalized,
    unless pooler_config says otherwise."""
    causal, _, decoder = qwen3
    st = str(tmp_path / "st")
    os.makedirs(os.path.join(st, "1_Pooling"))
    for name in os.listdir(causal):
        os.symlink(os.path.join(causal, name), os.path.join(st, name))
    with open(os.path.join(st, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"}], f)
    with open(os.path.join(st, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
                   "pooling_mode_cls_token": False, "pooling_mode_lasttoken": False}, f)
    llm = LLM(st, enable_multiprocessing=False, **BASE)
    try:
        pooler = llm.llm_engine.resolved.pooler
        assert (pooler.pooling_type, pooler.normalize) == ("MEAN", False)
        (out,) = llm.embed({"prompt_token_ids": PROMPTS[2]}, use_tqdm=False)
        with torch.no_grad():
            want = decoder(torch.tensor([PROMPTS[2]])).last_hidden_state[0].numpy().mean(0)
        np.testing.assert_allclose(out.outputs.embedding, want, rtol=1e-4, atol=1e-5)
    finally:
        llm.shutdown()
    llm = LLM(st, enable_multiprocessing=False, **dict(BASE, pooler_config={
        "pooling_type": "LAST", "normalize": True}))
    try:
        pooler = llm.llm_engine.resolved.pooler
        assert (pooler.pooling_type, pooler.normalize) == ("LAST", True)
    finally:
        llm.shutdown()


def test_async_encode_equals_offline_embed(qwen3):
    """AsyncLLM.encode (vLLM's): one PoolingRequestOutput per prompt, the same vector as
    LLM.embed; several at once are batched by the scheduler."""
    import asyncio

    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.async_engine import AsyncLLM

    causal, _, decoder = qwen3
    llm = AsyncLLM(EngineConfig(model=causal, enable_multiprocessing=False, **BASE))

    async def run():
        async def one(i, p):
            outs = [o async for o in llm.encode({"prompt_token_ids": p}, request_id=f"e{i}")]
            assert len(outs) == 1 and outs[0].finished
            return outs[0]
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    try:
        outs = asyncio.run(run())
        for p, o in zip(PROMPTS, outs):
            assert float(np.asarray(o.outputs.data, np.float64)
                         @ _reference(decoder, p, "LAST")) > 0.99999
    finally:
        llm.shutdown()


def test_data_parallel_pooling(qwen3):
    """Two engine-core processes: both pool (the DP client carries the vectors and the rank)."""
    causal, _, decoder = qwen3
    llm = LLM(causal, data_parallel_size=2, **BASE)
    try:
        prompts = [list(range(3, 3 + n)) for n in (5, 40, 17, 1, 9, 33)]
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        _check(outs, decoder, "LAST", prompts)
        assert all(r["num_steps"] > 0 for r in llm.llm_engine.get_stats()["per_rank"])
    finally:
        llm.shutdown()
