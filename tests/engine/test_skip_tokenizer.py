"""skip_tokenizer_init: a config-only folder with dummy weights, token ids in and out."""

from __future__ import annotations

import json

import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 50000,
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 7}
OPTS = dict(load_format="dummy", dtype="float32", max_model_len=128, max_num_seqs=4,
            max_num_batched_tokens=32, warmup=False, num_kv_blocks=40, seed=3)


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("config_only")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


def test_token_ids_in_and_out_without_a_tokenizer(config_only_dir, smollm2_dir):
    prompts = [{"prompt_token_ids": [5, 900, 31, 4000]}, {"prompt_token_ids": [42] * 20}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    llm = LLM(config_only_dir, skip_tokenizer_init=True, **OPTS)
    assert llm.get_tokenizer() is None
    assert llm.llm_engine.processor.eos_token_id == 7  # from config.json
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    # The same dummy model with a tokenizer generates the same ids (and, unlike here, text).
    with_tok = LLM(config_only_dir, tokenizer=smollm2_dir, **OPTS)
    refs = with_tok.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outs, refs):
        seq = out.outputs[0]
        assert len(seq.token_ids) == 8 and seq.token_ids == ref.outputs[0].token_ids
        assert seq.text == "" and ref.outputs[0].text != ""
        assert all(lp.decoded_token is None for pos in seq.logprobs for lp in pos.values())


def test_text_inputs_are_refused_naming_the_field(config_only_dir):
    llm = LLM(config_only_dir, skip_tokenizer_init=True, **OPTS)
    with pytest.raises(ValueError, match="prompt: a text prompt needs the tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="stop: stop strings need the tokenizer"):
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2, stop=["x"]),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs the tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    # ...and the engine keeps serving.
    out = llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_no_leaks(llm)
