"""Structured outputs: every output that finishes follows its spec, no masked token is ever
sampled, structured rows never disturb their neighbours, bad specs are refused by name.

The engine tests use a tiny random-weight model with SmolLM2's tokenizer: its logits know
nothing of JSON, so only the mask can make the outputs comply (and the specs are bounded so a
complying output must end)."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.sampling_params import StructuredOutputsParams as SO
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

# Per spec, at temperature 1.0 (plus one greedy); fewer with xgrammar (the same paths, and a
# second run of everything would lengthen CI).
NUM_SAMPLES = {"guidance": 50, "xgrammar": 12}

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                     "maxItems": 3},
            "owner": {"type": "object",
                      "properties": {"ok": {"type": "boolean"},
                                     "level": {"enum": ["low", "high", 3]}},
                      "required": ["ok", "level"], "additionalProperties": False},
        },
        "required": ["id", "tags", "owner"],
        "additionalProperties": False,
    },
    "array_of_numbers": {"type": "array", "minItems": 2, "maxItems": 4,
                         "items": {"type": "integer", "minimum": -50, "maximum": 50}},
}
# [0-9], not \d: the backends follow Rust's regex syntax, where \d is any Unicode digit.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
REGEXES = {
    "date": r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z0-9._]{1,10}@[a-z]{2,8}\.(com|org|net)",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
}
CHOICES = ["positive", "negative", "neutral"]
# A bounded arithmetic grammar in Lark (llguidance's dialect) and the same language as a regex.
LARK = """
start: expr
expr: term (OP term)?
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""
_TERM = r"([0-9]{1,3}|\([0-9]{1,3}[+\-*][0-9]{1,3}\))"
LARK_RE = rf"{_TERM}([+\-*]{_TERM})?"


def _specs():
    """(name, params, how to check). JSON without free whitespace: a random model would
    otherwise pad with whitespace until max_tokens."""
    specs = [(f"json-{k}", SO(json=v, disable_any_whitespace=True), ("json", v))
             for k, v in SCHEMAS.items()]
    specs += [("json_object", SO(json_object=True), ("json", {"type": "object"}))]
    specs += [(f"regex-{k}", SO(regex=v), ("regex", v)) for k, v in REGEXES.items()]
    specs += [("choice", SO(choice=CHOICES), ("choice", CHOICES)),
              ("grammar-lark", SO(grammar=LARK), ("regex", LARK_RE))]
    return specs


def _check(text: str, how) -> None:
    kind, ref = how
    if kind == "json":
        jsonschema.validate(json.loads(text), ref)
    elif kind == "regex":
        assert re.fullmatch(ref, text), text
    else:
        assert text in ref, text


# -- the mask on the device --------------------------------------------------------------------
def test_bitmask_masks_exactly_and_no_masked_token_is_ever_sampled():
    import jax
    import jax.numpy as jnp
    import llguidance.numpy as llnp

    from jaxinfer.layers.sampler import SamplingMetadata, sample_tokens
    from jaxinfer.runner.step_fn import apply_token_bitmask

    rng = np.random.default_rng(0)
    r, v = 24, 1003  # a vocab that is not a multiple of 32, and a padded bitmask word
    w = (v + 31) // 32 + 1
    allowed = rng.random((r, w * 32)) < rng.choice([0.001, 0.02, 0.5], size=(r, 1))
    allowed[np.arange(r), rng.integers(0, v, r)] = True  # at least one allowed token per row
    allowed[:, v:] = rng.random((r, w * 32 - v)) < 0.5  # bits past the vocab mean nothing
    bitmask = np.packbits(allowed.reshape(r, w, 32)[:, :, ::-1], axis=-1, bitorder="big")
    bitmask = bitmask.reshape(r, w, 4)[:, :, ::-1].copy().view("<i4").reshape(r, w)
    logits = rng.normal(size=(r, v)).astype(np.float32) * 5

    expected = logits.copy()
    llnp.apply_token_bitmask_inplace(expected, bitmask[:, : (v + 31) // 32])
    masked = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(masked, expected)
    np.testing.assert_array_equal(np.isfinite(masked), allowed[:, :v])

    def md(seed):
        k = np.random.default_rng(seed)
        return SamplingMetadata(
            temperature=k.choice([0.0, 0.5, 1.0, 2.0], r).astype(np.float32),
            top_k=k.choice([0, 1, 5, 50], r).astype(np.int32),
            top_p=k.choice([1.0, 0.9, 0.3], r).astype(np.float32),
            min_p=k.choice([0.0, 0.05], r).astype(np.float32),
            repetition_penalty=np.ones(r, np.float32), frequency_penalty=np.zeros(r, np.float32),
            presence_penalty=np.zeros(r, np.float32),
            seeds=k.integers(0, 2**32, r, dtype=np.uint32),
            output_index=k.integers(0, 100, r).astype(np.int32))

    sample = jax.jit(lambda lg, bm, m: sample_tokens(apply_token_bitmask(lg, bm), m))
    for seed in range(20):
        ids = np.asarray(sample(jnp.asarray(logits), jnp.asarray(bitmask), md(seed)))
        assert allowed[np.arange(r), ids].all(), seed


# -- parameters and configuration ----------------------------------------------------------------
def test_params_and_config_are_validated_by_name():
    with pytest.raises(ValueError, match="exactly one of"):
        SO(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        SO()
    with pytest.raises(ValueError, match="json is not valid JSON"):
        SO(json="{not json")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        SO(choice=[])
    assert SO(json='{"type": "integer"}').json == {"type": "integer"}
    with pytest.raises(ValueError, match="whitespace_pattern applies to JSON constraints only"):
        SO(regex="a+", whitespace_pattern=" ")
    with pytest.raises(ValueError, match="disable_any_whitespace applies to JSON constraints"):
        SO(choice=["a"], disable_any_whitespace=True)
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert p.structured_outputs == SO(regex="a+")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['regexp'\]"):
        SamplingParams(structured_outputs={"regexp": "a+"})
    with pytest.raises(ValueError, match="backend='outlines' is not supported"):
        EngineConfig(structured_outputs_config={"backend": "outlines"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['backnd'\]"):
        EngineConfig(structured_outputs_config={"backnd": "xgrammar"})
    assert EngineConfig(structured_outputs_config={"backend": "llguidance"}
                        ).structured_outputs_config.backend == "guidance"


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def tiny(request, tmp_path_factory, smollm2_dir):
    """The engine tests run once per backend (xgrammar: when installed)."""
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar")
    path = tmp_path_factory.mktemp("tiny-structured")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=3.0)
    # A small KV cache: the big batch below runs into preemptions.
    llm = LLM(str(path), dtype="float32", max_model_len=256, max_num_seqs=64,
              max_num_batched_tokens=256, warmup=False, num_kv_blocks=160, block_size=16,
              enable_multiprocessing=False,
              structured_outputs_config={"backend": request.param})
    llm.backend = request.param
    yield llm
    assert_no_leaks(llm)
    llm.shutdown()


def _core(llm):
    return llm.llm_engine.engine_core.core


def _main_backend_only(llm):
    """CI runs the spec suite with both backends, the rest with llguidance (the default);
    JAXINFER_SLOW_TESTS=1 runs everything with both."""
    import os

    if llm.backend != "guidance" and os.environ.get("JAXINFER_SLOW_TESTS") != "1":
        pytest.skip("slow: set JAXINFER_SLOW_TESTS=1 to run it with every backend")


def test_every_finished_output_follows_its_spec(tiny):
    specs = _specs()
    num = NUM_SAMPLES[tiny.backend]
    prompts, params, checks = [], [], []
    for k, (name, so, how) in enumerate(specs):
        for i in range(num + 1):
            greedy = i == num
            prompts.append(f"Answer with {name}, please. #{i}")
            params.append(SamplingParams(temperature=0.0 if greedy else 1.0, seed=1000 * k + i,
                                         max_tokens=120, structured_outputs=so))
            checks.append((name, how))
    t0 = time.perf_counter()
    outs = tiny.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    finished = {}
    for out, (name, how) in zip(outs, checks):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), (name, c.finish_reason, c.stop_reason)
        if c.finish_reason == "stop":
            _check(c.text, how)
        finished[name] = finished.get(name, 0) + (c.finish_reason == "stop")
    # Bounded languages: a complying output must end well within max_tokens (any JSON object
    # is not bounded).
    bounded = {k: v for k, v in finished.items() if k != "json_object"}
    assert all(n == num + 1 for n in bounded.values()), finished
    stats = tiny.llm_engine.get_stats()
    assert stats["num_grammar_rejections"] == 0  # every sampled token was allowed
    if tiny.backend == "guidance":  # (the smaller xgrammar batch may fit)
        assert stats["num_preemptions"] > 0, "the test meant to cover preemption"
    print(f"{len(outs)} structured requests in {seconds:.1f}s; grammar compiles "
          f"{stats['num_grammar_compiles']} ({stats['grammar_compile_seconds']:.2f}s)")


def test_mixed_batches_keep_rows_aligned(tiny):
    _main_backend_only(tiny)
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)]
    structured = SamplingParams(temperature=1.0, seed=11, max_tokens=40,
                                structured_outputs=SO(json=SCHEMAS["person"]))
    alone = [tiny.generate("Tell me a story", p, use_tqdm=False)[0].outputs[0].token_ids
             for p in plain]
    s_alone = tiny.generate("Who are you?", structured, use_tqdm=False)[0].outputs[0]
    mixed_prompts = ["Who are you?", "Tell me a story", "Hi", "Tell me a story", "Who are you?"]
    mixed_params = [structured, plain[0], structured.clone(seed=12), plain[1],
                    SamplingParams(temperature=0.0, max_tokens=30,
                                   structured_outputs=SO(regex=REGEXES["date"]))]
    outs = tiny.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone[0]
    assert outs[3].outputs[0].token_ids == alone[1]
    assert outs[0].outputs[0].token_ids == s_alone.token_ids
    assert re.fullmatch(REGEXES["date"], outs[4].outputs[0].text)


def test_n_children_each_follow_the_grammar(tiny):
    _main_backend_only(tiny)
    out = tiny.generate("Pick one", SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=10,
                                                   structured_outputs=SO(choice=CHOICES)),
                        use_tqdm=False)[0]
    assert len(out.outputs) == 6
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in out.outputs)
    out = tiny.generate("Say", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20,
                                              structured_outputs=SO(regex="[a-z]{4,8}")),
                        use_tqdm=False)[0]
    assert all(re.fullmatch("[a-z]{4,8}", c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1  # children sample independently


@pytest.mark.parametrize("so, match", [
    (SO(json={"type": "foo"}), r"structured_outputs\.json: .*foo"),
    (SO(json={"type": "object", "properties": {"a": {"type": "string", "pattern": "a(b"}}}),
     r"structured_outputs\.json"),
    (SO(regex="a(b"), r"(?s)structured_outputs\.regex: .*(unclosed group|not closed)"),
    (SO(grammar="start: foo\nfoo: 'a' | bar"), r"structured_outputs\.grammar"),
    (SO(structural_tag='{"triggers": ["<f"], "structures": [{"begin": "<g>"}]}'),
     r"structured_outputs\.structural_tag"),
])
def test_bad_specs_are_refused_and_the_engine_keeps_serving(tiny, so, match):
    _main_backend_only(tiny)
    with pytest.raises(ValueError, match=match):
        tiny.generate("x", SamplingParams(structured_outputs=so), use_tqdm=False)
    out = tiny.generate("x", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_no_leaks(tiny)


def test_structural_tag_constrains_the_tagged_part(tiny, smollm2_dir):
    _main_backend_only(tiny)
    from jaxinfer.tokenizer import Tokenizer

    tag = {"triggers": ["<fn>"], "structures": [
        {"begin": "<fn>", "schema": {"type": "object", "properties": {"x": {"enum": [1, 2]}},
                                     "required": ["x"], "additionalProperties": False},
         "end": "</fn>"}]}
    so = SO(structural_tag=json.dumps(tag))
    manager = _core(tiny).structured_output_manager
    backend = manager.get(tiny.backend)
    tok = Tokenizer(smollm2_dir)
    grammar = backend.new_grammar(backend.compile(so))
    assert grammar.accept_tokens(tok.encode("Some free text, then"))  # free text: anything
    bm = np.zeros((1, manager.width), np.int32)
    grammar.fill_bitmask(bm, 0)
    assert np.unpackbits(bm.view(np.uint8)).sum() > 10000
    assert grammar.accept_tokens(tok.encode(" <fn>"))  # the trigger: now the schema applies
    grammar.fill_bitmask(bm, 0)
    bits = np.unpackbits(bm.view(np.uint8), bitorder="little")[: backend.vocab_size]
    allowed = [tok.decode([i]) for i in np.flatnonzero(bits)]
    assert "{" in allowed and all(t.strip() in ("", "{", '{"', '{"x', '{"x"') for t in allowed), \
        allowed[:20]
    assert grammar.accept_tokens(tok.encode('{"x": 2}</fn>'))
    # Through the engine: the outputs end and nothing masked is sampled.
    outs = tiny.generate([f"call {i}" for i in range(4)],
                         SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                                        structured_outputs=so), use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert tiny.llm_engine.get_stats()["num_grammar_rejections"] == 0


def test_slow_grammar_times_out_without_holding_up_others(tiny, monkeypatch):
    _main_backend_only(tiny)
    core = _core(tiny)
    manager = core.structured_output_manager
    backend = manager.get(tiny.backend)
    real_compile = backend.compile

    def slow_compile(params):
        if params.regex == "slow+":
            time.sleep(2.0)
        return real_compile(params)

    monkeypatch.setattr(backend, "compile", slow_compile)
    monkeypatch.setattr(manager, "config", dataclasses.replace(manager.config,
                                                               compile_timeout_s=0.5))
    outs = tiny.generate(["a", "b"], [
        SamplingParams(structured_outputs=SO(regex="slow+"), max_tokens=5),
        SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert "compile_timeout_s=0.5" in outs[0].outputs[0].stop_reason
    assert len(outs[1].outputs[0].token_ids) == 4
    m = outs[1].metrics
    assert m.first_token_time - m.arrival_time < 1.5  # not held up by the compile
    time.sleep(2.0)  # let the abandoned compile finish before other tests
    assert_no_leaks(tiny)


def test_async_scheduling_gives_the_same_structured_outputs(tmp_path, smollm2_dir):
    make_tiny_model_dir(tmp_path, "llama", smollm2_dir, sharpen=3.0)
    prompts = [f"q{i}" for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                             structured_outputs=SO(json=SCHEMAS["nested"],
                                                   disable_any_whitespace=True)
                             if i % 2 else None)
              for i in range(6)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=128, warmup=False, num_kv_blocks=64,
                  async_scheduling=async_scheduling)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
            for o, p in zip(outs, params):
                if p.structured_outputs is not None:
                    assert o.outputs[0].finish_reason == "stop"
                    jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["nested"])
            assert_no_leaks(llm)
        finally:
            llm.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_padded_model_vocab_is_masked(backend, smollm2_dir):
    """A model vocabulary larger than the tokenizer's (padded LM head): ids past the tokenizer
    are never allowed, even where the grammar allows almost anything."""
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    from jaxinfer.config import StructuredOutputsConfig
    from jaxinfer.structured_output import StructuredOutputManager
    from jaxinfer.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    vocab = tok.vocab_size + 64
    manager = StructuredOutputManager(StructuredOutputsConfig(backend=backend),
                                      lambda: (tok.backend_json(), tok.eos_token_id), vocab)
    assert manager.width == (vocab + 31) // 32

    class Req:  # what the manager reads of a request
        structured_backend, eos_token_id = backend, tok.eos_token_id
        reasoning_end_ids = None  # (not behind a reasoning model's thinking)

    req = Req()
    be = manager.get(backend)
    req.grammar = be.new_grammar(be.compile(SO(regex="(.|\n)*")))
    bits = np.unpackbits(manager.grammar_bitmask([req]).view(np.uint8), bitorder="little")
    assert bits[: tok.vocab_size].sum() > tok.vocab_size // 2  # almost anything
    assert not bits[tok.vocab_size:].any()  # but no padded id
    manager.shutdown()


def test_grammar_applies_after_the_thinking_ends(tiny, monkeypatch):
    """--reasoning-parser: a request whose prompt leaves the model thinking gets its grammar
    only once its output ends with the end tag's ids. Before, its tokens are the model's own
    (those of an unconstrained run: its bitmask rows allow everything, beside a constrained
    request's rows in the same steps); after, they follow the grammar."""
    _main_backend_only(tiny)
    from jaxinfer.reasoning import get_reasoning_parser

    prompt = "Think first, then answer with four digits."
    free = list(tiny.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16,
                                                       ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids)
    # A two-token "end tag": the pair the model writes at k, seen nowhere before it.
    k = next(i for i in range(3, len(free)) if free[i - 1:i + 1] not in
             [free[j - 1:j + 1] for j in range(1, i)])
    end = free[k - 1:k + 1]
    proc = tiny.llm_engine.processor
    monkeypatch.setattr(proc, "reasoning", get_reasoning_parser("deepseek_r1"))
    monkeypatch.setattr(proc, "_reasoning_end_ids", end)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            structured_outputs=SO(regex="[0-9]{4}"))
    # The second prompt closes the thinking itself (as a template with thinking off does).
    thinking, direct = tiny.generate([prompt, "Answer with four digits.</think>"],
                                     [params, params], use_tqdm=False)
    ids = list(thinking.outputs[0].token_ids)
    assert ids[:k + 1] == free[:k + 1]
    assert re.fullmatch("[0-9]{4}", tiny.get_tokenizer().decode(ids[k + 1:])), ids
    assert thinking.outputs[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{4}", direct.outputs[0].text)
    assert tiny.llm_engine.get_stats()["num_grammar_rejections"] == 0
    assert_no_leaks(tiny)
