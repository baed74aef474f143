"""logit_bias, allowed_token_ids and bad_words (OpenAI's and vLLM's fields): applied in the step
on the device (the bias added to the logits, the masks as rows of the token bitmask), alone
and beside requests without them, through the engine-core process, with async scheduling and
with speculative decoding."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

N = 10
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-token-controls")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
            warmup=False, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = LLM(tiny_dir, **OPTS)  # (the core in its own process: the fields cross msgpack)
    yield llm
    assert_no_leaks(llm)
    llm.shutdown()


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kw)


def ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def base(llm):
    return ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))


def test_logit_bias_bans_and_forces(llm, base):
    first = base[0][0]
    forced = next(t for t in range(100, 200) if all(t not in b for b in base))
    many = {t: -100.0 for t in range(200, 400)}  # (a bigger bucket)
    params = [greedy(logit_bias={first: -100.0}), greedy(logit_bias={forced: 100.0}),
              greedy(logit_bias=many), greedy()]
    banned, forced_out, many_out, plain = ids(llm.generate(
        [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]], params, use_tqdm=False))
    assert first not in banned and banned != base[0]
    assert forced_out == [forced] * N
    assert not set(many_out) & set(many)
    assert plain == base[2]  # its neighbours' biases stay in their rows
    # A bias too small to change the argmax changes nothing.
    (same,) = ids(llm.generate([PROMPTS[0]], greedy(logit_bias={forced: 1e-3}),
                               use_tqdm=False))
    assert same == base[0]


def test_allowed_token_ids(llm, base):
    allowed = [11, 42, 1000, 2000]
    only, plain = ids(llm.generate(PROMPTS[:2], [greedy(allowed_token_ids=allowed), greedy()],
                                   use_tqdm=False))
    assert set(only) <= set(allowed) and plain == base[1]
    # With a bias on one allowed token, that one wins.
    (biased,) = ids(llm.generate([PROMPTS[0]], greedy(allowed_token_ids=allowed,
                                                      logit_bias={1000: 100.0}),
                                 use_tqdm=False))
    assert biased == [1000] * N


def test_bad_words(llm, base):
    out = base[0]
    two = [out[2], out[3]]  # a two-token word the model writes at 2
    params = greedy(bad_words_token_ids=[two, [out[0]]])
    (got,) = ids(llm.generate([PROMPTS[0]], params, use_tqdm=False))
    assert out[0] not in got
    assert all(got[i:i + 2] != two for i in range(len(got) - 1))
    # As words: the front end tokenizes them (as written and after a space).
    tok = llm.get_tokenizer()
    word = tok.decode([out[1]]).strip() or "the"
    seqs = llm.llm_engine.processor.tokenize_bad_words([word])
    (got,) = ids(llm.generate([PROMPTS[0]], greedy(bad_words=[word]), use_tqdm=False))
    for seq in seqs:
        assert all(got[i:i + len(seq)] != seq for i in range(len(got))), (word, seqs)


def test_fields_are_checked_against_the_vocabulary(llm):
    v = llm.llm_engine.model_config.vocab_size
    for bad, field in ((dict(logit_bias={v: 1.0}), "logit_bias"),
                       (dict(allowed_token_ids=[0, v]), "allowed_token_ids"),
                       (dict(bad_words_token_ids=[[v]]), "bad_words")):
        with pytest.raises(ValueError, match=field):
            llm.generate(["x"], greedy(**bad), use_tqdm=False)
    llm.generate(["x"], greedy(), use_tqdm=False)  # (and the engine keeps serving)


@pytest.mark.parametrize("extra", [dict(async_scheduling=False),
                                   dict(speculative_config={"method": "ngram",
                                                            "num_speculative_tokens": 3})],
                         ids=["sync-scheduling", "ngram-spec-decode"])
def test_same_tokens_with_sync_scheduling_or_drafts(tiny_dir, llm, base, extra):
    """The bias and masks are the same in the other step loops than the default async one
    (where bad words need the previous token: those steps wait for it): sync scheduling, and
    drafts verified on the device (the bias and allowed rows per verify position; bad-word
    requests take no drafts)."""
    out = base[0]
    forced = next(t for t in range(100, 200) if t not in out)
    prompts = [PROMPTS[0]] * 4 + [PROMPTS[1]]
    # (forced and two-token outputs repeat themselves: the n-gram proposer drafts for them)
    params = [greedy(logit_bias={out[0]: -100.0, out[4]: 5.0}),
              greedy(logit_bias={forced: 100.0}),
              greedy(allowed_token_ids=[out[1], out[2]]),
              greedy(bad_words_token_ids=[[out[2], out[3]], [out[5]]]), greedy()]
    want = ids(llm.generate(prompts, params, use_tqdm=False))
    other = LLM(tiny_dir, enable_multiprocessing=False, **OPTS, **extra)
    try:
        assert ids(other.generate(prompts, params, use_tqdm=False)) == want
        if "speculative_config" in extra:  # (drafts were verified, the bias among them)
            assert other.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0
        assert_no_leaks(other)
    finally:
        other.shutdown()
