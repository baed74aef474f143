"""--generation-config (vLLM's): the model's generation_config.json gives the default
sampling parameters offline (LLM.get_default_sampling_params, generate without params) and on
the server (fields a request leaves unset); "vllm" turns it off; a folder names another file;
bad values are refused naming generation_config."""

from __future__ import annotations

import json

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig, resolve_config
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

GEN = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7, "top_k": 1,
       "max_new_tokens": 5, "do_sample": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("gen")
    make_tiny_model_dir(path, "llama", smollm2_dir)
    (path / "generation_config.json").write_text(json.dumps(GEN))
    return path


def test_defaults_offline(model_dir, tmp_path):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, warmup=False, num_kv_blocks=20,
              enable_multiprocessing=False)
    want = SamplingParams(temperature=0.7, top_k=1, max_tokens=5)
    assert llm.get_default_sampling_params() == want
    # top_k=1 at any temperature is the argmax: generate() without params = greedy, 5 tokens
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    out = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5 and out.token_ids == greedy.token_ids[:len(out.token_ids)]
    assert_no_leaks(llm)
    llm.shutdown()
    assert resolve_config(EngineConfig(model=str(model_dir), generation_config="vllm")
                          ).default_sampling == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert resolve_config(EngineConfig(model=str(model_dir), generation_config=str(other))
                          ).default_sampling == {"top_p": 0.5}
    (other / "generation_config.json").write_text(json.dumps({"top_p": 5.0}))
    with pytest.raises(ValueError, match="generation_config.*top_p"):
        resolve_config(EngineConfig(model=str(model_dir), generation_config=str(other)))
    with pytest.raises(ValueError, match="generation_config"):
        resolve_config(EngineConfig(model=str(model_dir), generation_config=str(tmp_path)))
