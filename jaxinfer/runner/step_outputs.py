"""Reading a finished step's outputs back on the host: the sampled (or, speculative decoding,
accepted) tokens written into the InputBatch, and the RunnerOutput the scheduler takes, with
logprobs and prompt logprobs per request."""

from __future__ import annotations

import numpy as np

from jaxinfer.outputs import Logprobs, RunnerOutput
from jaxinfer.runner.input_batch import InputBatch
from jaxinfer.runner.step_builder import BuiltStep


def write_sampled(b: InputBatch, out: dict, step: BuiltStep, positions: np.ndarray):
    """Plain steps: each sampling row's token into its slot, at the position counted for it at
    dispatch. The slot may have been freed (finished) or re-used since."""
    tokens = out["token_ids"]
    for i, (rid, s) in enumerate(zip(step.req_ids, step.slots)):
        if step.samples[i] and b.req_id_to_slot.get(rid) == s:
            n = positions[i]
            if n < b.token_ids.shape[1]:
                b.token_ids[s, n] = tokens[i]
            b.pending[s] -= 1


def write_accepted(b: InputBatch, out: dict, step: BuiltStep, positions: np.ndarray):
    """Speculative steps: each row's emitted tokens (accepted drafts + one), its token count
    rolled back by the rejected drafts (their KV is garbage, recomputed later). Returns the
    rows that sampled (request ids, slots) and, with in-step drafting, their next drafts."""
    tokens, emitted = out["token_ids"], out["num_emitted"]
    rows, slots = [], []
    for i, (rid, s) in enumerate(zip(step.req_ids, step.slots)):
        if not step.samples[i] or b.req_id_to_slot.get(rid) != s:
            continue
        e = int(emitted[i])
        n = positions[i]
        m = min(e, b.token_ids.shape[1] - n)
        b.token_ids[s, n : n + m] = tokens[i, :m]
        b.num_tokens[s] += e - 1  # (the rejected drafts' KV: the scheduler rolls back)
        b.pending[s] -= 1
        rows.append(rid)
        slots.append(s)
    drafts = None
    if "drafts" in out:
        index = {rid: i for i, rid in enumerate(step.req_ids)}
        drafts = out["drafts"][[index[r] for r in rows]]
    return (rows, np.array(slots, np.int32)), drafts


def prompt_logprobs(pl_out, step: BuiltStep) -> dict:
    """Per request: Logprobs of the prompt tokens this step predicted (None for token 0)."""
    chosen, rank, top_ids, top_lps = pl_out
    batch = step.batch
    computed, qsl = step.computed, batch.attn.query_start_loc
    result = {}
    for i, rid in enumerate(step.req_ids):
        k = step.num_prompt_logprobs[i]
        n_prompt = step.num_prompt_tokens[i]
        if k < 0 or computed[i] >= n_prompt:
            continue
        entries = [None] if computed[i] == 0 else []
        for j in range(qsl[i], qsl[i + 1]):
            pos = computed[i] + (j - qsl[i])
            if pos + 1 >= n_prompt:
                break
            entries.append(Logprobs(
                token_id=int(batch.next_token_ids[j]), logprob=float(chosen[j]),
                rank=int(rank[j]), top_ids=tuple(int(x) for x in top_ids[j, :k]),
                top_logprobs=tuple(float(x) for x in top_lps[j, :k])))
        result[rid] = tuple(entries)
    return result


def runner_output(out: dict, step: BuiltStep) -> RunnerOutput:
    """The step's tokens (and logprobs) per request, in row order."""
    sampled, logprobs = [], {}
    token_ids = out["token_ids"].tolist()
    emitted = out.get("num_emitted")
    row_map = step.batch.row_map
    lp = out.get("logprobs")
    for i, rid in enumerate(step.req_ids):
        if not step.samples[i]:
            sampled.append(())  # partial prefill: no token
            continue
        if emitted is None:
            toks, flat = (token_ids[i],), (i,)
        else:
            e = int(emitted[i])
            toks, flat = tuple(token_ids[i][:e]), row_map[i, :e]
        sampled.append(toks)
        k = step.num_logprobs[i]
        if k >= 0:
            logprobs[rid] = tuple(Logprobs(
                token_id=tok, logprob=float(lp.logprob[f]), rank=int(lp.rank[f]),
                top_ids=tuple(int(x) for x in lp.top_ids[f, :k]),
                top_logprobs=tuple(float(x) for x in lp.top_logprobs[f, :k]))
                for tok, f in zip(toks, flat))
    prompt_lps = prompt_logprobs(out["prompt_logprobs"], step) if "prompt_logprobs" in out \
        else {}
    return RunnerOutput(req_ids=tuple(step.req_ids), sampled_token_ids=tuple(sampled),
                        logprobs=logprobs, prompt_logprobs=prompt_lps)
