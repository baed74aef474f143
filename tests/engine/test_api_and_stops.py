"""LLM API behaviour on the real SmolLM2: stop conditions, text, chat, validation, compiles."""

from __future__ import annotations

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from tests.engine.conftest import assert_no_leaks


PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def greedy_ref(smol):
    out = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    return out


def test_stop_string_spanning_token_boundary(smol, greedy_ref):
    tok = smol.get_tokenizer()
    ids = greedy_ref.token_ids
    # A stop string made of the end of token 3 and the start of token 4.
    a, b = tok.decode(ids[:4]), tok.decode(ids[:5])
    assert len(a) >= 2 and len(b) > len(a) + 1
    stop = a[-2:] + b[len(a)]
    assert stop not in a[:-2] + a[-2:-1]  # it first appears across the boundary
    first = greedy_ref.text.find(stop)
    for include in (False, True):
        out = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                   include_stop_str_in_output=include,
                                                   ignore_eos=True), use_tqdm=False)[0]
        o = out.outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert o.text == greedy_ref.text[: first + (len(stop) if include else 0)]
        assert o.token_ids == greedy_ref.token_ids[:5]
    assert_no_leaks(smol)


def test_stop_token_ids_and_max_tokens_and_min_tokens(smol, greedy_ref):
    ids = greedy_ref.token_ids
    third = ids[2]
    out = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                               stop_token_ids=[third]), use_tqdm=False)[0]
    o = out.outputs[0]
    assert (o.finish_reason, o.stop_reason) == ("stop", third)
    assert o.token_ids == ids[:3]
    assert o.text == smol.get_tokenizer().decode(ids[:2])  # the stop token is not rendered
    o = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert (o.finish_reason, o.token_ids) == ("length", ids[:5])
    # min_tokens suppresses stopping on that token until enough tokens were generated.
    o = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                             min_tokens=4, stop_token_ids=[ids[1]]),
                      use_tqdm=False)[0].outputs[0]
    later = [i for i, t in enumerate(ids) if t == ids[1] and i >= 3]
    assert o.token_ids == (ids[: later[0] + 1] if later else ids)


def test_eos_finishes_chat_and_chat_matches_generate(smol):
    conv = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = smol.chat(conv, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason is None
    assert o.token_ids[-1] == smol.get_tokenizer().eos_token_id
    assert "Paris" in o.text and "<|im_end|>" not in o.text
    ids = smol.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True)
    again = smol.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=40),
                          use_tqdm=False)[0]
    assert again.outputs[0].token_ids == o.token_ids
    two = smol.chat([conv, [{"role": "user", "content": "Say hi."}]],
                    SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == o.token_ids[:8]


def test_incremental_detokenizer_non_ascii(smol):
    tok = smol.get_tokenizer()
    text = " naïve café — 日本語のテキスト 🤗🚀 ünïcödé"
    ids = tok(text)["input_ids"]
    d = IncrementalDetokenizer(tok, tok("Say:")["input_ids"], skip_special_tokens=True, stop=[],
                               include_stop_str_in_output=False, min_tokens=0)
    for i in ids:
        d.update([i], stop_terminated=False)
        assert "\ufffd" not in d.output_text
    assert d.output_text == text


def test_non_ascii_generation_text_matches_decode(smol):
    conv = [{"role": "user", "content": "Write the word 'café' and the emoji 🤗 three times."}]
    o = smol.chat(conv, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert any(ord(c) > 127 for c in o.text)
    toks = o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids
    assert o.text == smol.get_tokenizer().decode(toks, skip_special_tokens=True)


def test_bad_input_is_rejected_and_engine_keeps_serving(smol):
    tok = smol.get_tokenizer()
    with pytest.raises(ValueError, match=r"300 tokens.*max_model_len=256"):
        smol.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"SamplingParams.temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"SamplingParams.top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"SamplingParams.max_tokens"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match=r"out of vocabulary"):
        smol.generate({"prompt_token_ids": [1, 10**7]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        smol.generate({"prompt_token_ids": []}, use_tqdm=False)
    # A batch with one bad prompt submits nothing, and the engine serves the next call.
    with pytest.raises(ValueError):
        smol.generate(["fine", {"prompt_token_ids": [5] * 300}], use_tqdm=False)
    assert_no_leaks(smol)
    ok = smol.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3
    assert ok[0].metrics.first_token_time >= ok[0].metrics.arrival_time
    assert ok[0].metrics.finished_time >= ok[0].metrics.first_token_time
    assert tok is not None


def test_abort_mid_generation_frees_everything(smol):
    eng = smol.llm_engine
    eng.add_request("a1", "Tell me a long story", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("a2", "Tell me another", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort_request(["a1"])
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == "a2"
    assert_no_leaks(smol)


def test_cache_salt_in_prompt_dicts(smol):
    """vLLM's {"prompt": ..., "cache_salt": ...}: the same prompt under another salt (or none)
    hits nothing its first time; under its own salt again it hits a whole block. Unknown
    prompt keys and bad salts are refused by name."""
    prompt = "the quick brown fox jumps over the lazy dog " * 20  # > one 128-token block
    params = SamplingParams(temperature=0, max_tokens=1)

    def hits(p):
        before = smol.llm_engine.call_utility("get_stats")["prefix_cache_hits"]
        smol.generate(p, params, use_tqdm=False)
        return smol.llm_engine.call_utility("get_stats")["prefix_cache_hits"] - before

    hits({"prompt": prompt, "cache_salt": "a"})
    assert hits({"prompt": prompt, "cache_salt": "b"}) == 0
    assert hits(prompt) == 0
    assert hits({"prompt": prompt, "cache_salt": "a"}) >= 128
    for bad, match in (({"prompt": "x", "cache_salt": ""}, "cache_salt"),
                       ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
                       ({"prompt": "x", "multi_modal_data": {}}, "multi_modal_data")):
        with pytest.raises(ValueError, match=match):
            smol.generate(bad, params, use_tqdm=False)
    assert_no_leaks(smol)


def test_chat_template_kwargs_offline(smol):
    """LLM.chat(chat_template_kwargs=...) (vLLM's): extra variables reach the template."""
    template = "{{ messages[0]['content'] }}{% if shout %}!!!{% endif %}"
    conv = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    plain = smol.chat(conv, params, use_tqdm=False, chat_template=template)[0]
    loud = smol.chat(conv, params, use_tqdm=False, chat_template=template,
                     chat_template_kwargs={"shout": True})[0]
    tok = smol.get_tokenizer()
    assert tok.decode(plain.prompt_token_ids) == "hi"
    assert tok.decode(loud.prompt_token_ids) == "hi!!!"
