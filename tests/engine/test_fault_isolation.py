"""Fault isolation in the engine core: a request that fails while it is admitted, while its
inputs are built or while its outputs are applied ends alone with finish_reason "error"; every
other request finishes with exactly the tokens it gets without the failing one, and nothing
leaks. Only a failure of the device step itself is fatal."""

from __future__ import annotations

import pytest

import jaxinfer.core.scheduler as scheduler_module
from jaxinfer import LLM, SamplingParams
from jaxinfer.runner.input_batch import InputBatch
from tests.engine.conftest import assert_no_leaks, make_tiny_model_dir

OPTS = dict(dtype="float32", max_model_len=96, max_num_seqs=6, max_num_batched_tokens=32,
            warmup=False, num_kv_blocks=60, block_size=8)
PROMPTS = [[1000 + 37 * i + j for j in range(5 + 7 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-faults")
    make_tiny_model_dir(path, "llama", smollm2_dir, sharpen=2.0)
    return str(path)


def _params(i):
    return SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True)


def _run(eng, extra: dict[str, tuple[list[int], SamplingParams]]):
    """The 4 good requests plus `extra` (request id -> (prompt, params)), interleaved."""
    ids = []
    for i, p in enumerate(PROMPTS):
        ids.append(eng.add_request(f"good{i}", {"prompt_token_ids": p}, _params(i)))
        if i == 1:
            for rid, (prompt, params) in extra.items():
                eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return outs


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(tiny_dir, enable_multiprocessing=False, **OPTS)
    outs = _run(llm.llm_engine, {})
    assert_no_leaks(llm)
    llm.shutdown()
    return {rid: o.token_ids for rid, o in outs.items()}


def _check_others(outs, reference):
    for rid, toks in reference.items():
        assert outs[rid].finish_reason == "length" and outs[rid].token_ids == toks, rid


def test_input_building_and_output_failures_fail_one_request(tiny_dir, reference, monkeypatch):
    """Injected: InputBatch.add raises for one request (its inputs cannot be built), and the
    scheduler's stop check raises for another after its 3rd token (its output cannot be
    applied). In process, so the patches reach the core."""
    add, check_stop = InputBatch.add, scheduler_module.check_stop

    def bad_add(self, new):
        if new.req_id.startswith("bad_in-"):
            self.top_k[0] = 2**31  # what an unchecked top_k did: OverflowError
        return add(self, new)

    def bad_stop(request, max_model_len):
        if request.request_id.startswith("bad_out-") and request.num_output_tokens == 3:
            raise RuntimeError("injected")
        return check_stop(request, max_model_len)

    monkeypatch.setattr(InputBatch, "add", bad_add)
    monkeypatch.setattr(scheduler_module, "check_stop", bad_stop)
    llm = LLM(tiny_dir, enable_multiprocessing=False, **OPTS)
    outs = _run(llm.llm_engine, {"bad_in": ([5, 6, 7], _params(0)),
                                 "bad_out": ([8, 9, 10, 11], _params(0))})
    _check_others(outs, reference)
    bad_in, bad_out = outs["bad_in"], outs["bad_out"]
    assert bad_in.finish_reason == "error" and bad_in.token_ids == []
    assert "preparing the request's inputs" in bad_in.stop_reason
    assert "OverflowError" in bad_in.stop_reason
    assert bad_out.finish_reason == "error" and len(bad_out.token_ids) == 2
    assert "RuntimeError: injected" in bad_out.stop_reason
    assert llm.llm_engine.get_stats()["num_running_reqs"] == 0
    assert_no_leaks(llm)
    # The engine goes on serving.
    again = llm.generate({"prompt_token_ids": PROMPTS[0]}, _params(0), use_tqdm=False)
    assert again[0].outputs[0].token_ids == reference["good0"]
    assert llm.llm_engine.scheduler.num_failed_requests == 2
    llm.shutdown()


def test_a_failing_grammar_mask_fails_its_request_only(tiny_dir, monkeypatch):
    from jaxinfer.structured_output import StructuredOutputManager
    from jaxinfer.structured_output.backends import GuidanceBackend

    attach, fill = StructuredOutputManager._attach, GuidanceBackend.fill_bitmasks

    def marked_attach(self, request):
        attach(self, request)
        request.grammar.explode = request.request_id.startswith("badg-")

    def exploding_fill(self, grammars, bitmask):
        if any(getattr(g, "explode", False) for g in grammars):
            raise RuntimeError("mask failed")
        return fill(self, grammars, bitmask)

    monkeypatch.setattr(StructuredOutputManager, "_attach", marked_attach)
    monkeypatch.setattr(GuidanceBackend, "fill_bitmasks", exploding_fill)
    llm = LLM(tiny_dir, enable_multiprocessing=False, **OPTS)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs={"choice": ["yes", "no"]})
    outs = _run(llm.llm_engine, {"okg": ([1, 2, 3], choice), "badg": ([1, 2, 3], choice)})
    assert outs["badg"].finish_reason == "error" and "mask failed" in outs["badg"].stop_reason
    assert outs["okg"].finish_reason == "stop" and outs["okg"].text in ("yes", "no")
    assert all(outs[f"good{i}"].finish_reason == "length" for i in range(4))
    assert_no_leaks(llm)
    llm.shutdown()


def test_malformed_requests_reaching_the_core_process(tiny_dir, reference):
    """Requests that bypass the front end's checks, sent to the engine-core process: one whose
    SamplingParams do not even decode (top_k = 2**31), one whose prompt has a token id out of
    the vocabulary. Each ends with "error" naming its problem; the others are unchanged and
    the core process keeps serving."""
    llm = LLM(tiny_dir, **OPTS)
    eng = llm.llm_engine
    assert eng.multiprocessing
    for rid, prompt in (("bad_topk", [1, 2, 3]), ("bad_ids", [1, 2])):
        _, ids, children = eng.processor.make_requests(rid, {"prompt_token_ids": prompt},
                                                       _params(0))
        if rid == "bad_topk":  # (what the processor refuses; the core must too)
            object.__setattr__(children[0].sampling_params, "top_k", 2**31)
        else:
            children[0].prompt_token_ids = [1, 10**6]
        eng.output_processor.add_request(rid, None, ids, children)
        for child in children:
            eng.engine_core.add_request(child)
    outs = _run(eng, {})
    _check_others(outs, reference)
    assert outs["bad_topk"].finish_reason == "error"
    assert "top_k" in outs["bad_topk"].stop_reason and "2147483647" in outs["bad_topk"].stop_reason
    assert outs["bad_ids"].finish_reason == "error"
    assert "1000000" in outs["bad_ids"].stop_reason
    assert_no_leaks(llm)
    llm.shutdown()
