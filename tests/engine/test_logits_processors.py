"""Custom logits processors (jaxinfer/logits_processors.py): applied in the step, in batch, to
the rows whose requests ask for them through extra_args, beside rows that do not; through the
engine-core process (named by import path), with verified drafts; unknown extra_args keys and
bad values refused by name."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir
from tests.engine.logits_processor_examples import BanToken, Boost

N = 8
OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
            warmup=False, num_kv_blocks=64)
PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-logits-processors")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    # One by class, one by vLLM-style dotted path; the core runs in its own process.
    llm = LLM(tiny_dir, logits_processors=[BanToken,
                                           "tests.engine.logits_processor_examples.Boost"],
              **OPTS)
    yield llm
    assert_no_leaks(llm)
    llm.shutdown()


def greedy(**extra):
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True,
                          extra_args=extra or None)


def ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_processors_apply_to_the_rows_that_ask(llm):
    base = ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    first = base[0][0]
    forced = next(t for t in range(100, 200) if all(t not in b for b in base))
    banned, boosted, both, plain = ids(llm.generate(
        [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1]],
        [greedy(ban_token=first), greedy(boost=[forced, 1000.0]),
         greedy(ban_token=forced, boost=[forced, 1000.0]), greedy()], use_tqdm=False))
    assert first not in banned and banned != base[0]
    assert boosted == [forced] * N
    assert forced not in both  # (both processors on one row: the ban wins over the boost)
    assert plain == base[1]


def test_unknown_keys_and_bad_values_are_refused(llm):
    with pytest.raises(ValueError, match=r"extra_args.*\['colour'\].*ban_token"):
        llm.generate(["x"], greedy(colour="red"), use_tqdm=False)
    with pytest.raises(ValueError, match="ban_token must be a token id"):
        llm.generate(["x"], greedy(ban_token="seven"), use_tqdm=False)
    with pytest.raises(ValueError, match="not a subclass"):
        LLM("unused", logits_processors=["jaxinfer.sampling_params:SamplingParams"])
    with pytest.raises(ValueError, match="cannot import"):
        LLM("unused", logits_processors=["no_such_module.Thing"])
    llm.generate(["x"], greedy(), use_tqdm=False)  # (the engine keeps serving)


def test_with_verified_drafts(tiny_dir, llm):
    """The processors in the verify step of speculative decoding: the same tokens."""
    params = [greedy(boost=[150, 1000.0]), greedy(ban_token=150), greedy()]
    want = ids(llm.generate(PROMPTS[:1] * 3, params, use_tqdm=False))
    spec = LLM(tiny_dir, logits_processors=[BanToken, Boost], enable_multiprocessing=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **OPTS)
    try:
        assert ids(spec.generate(PROMPTS[:1] * 3, params, use_tqdm=False)) == want
        assert spec.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0
    finally:
        spec.shutdown()
