"""The scheduler's LoRA rule (vLLM's): at most max_loras distinct adapters in one step; a
waiting request whose adapter finds no room is not starved by later requests of the
running adapters; base-model requests are never held back by it."""

from __future__ import annotations

from jaxinfer.lora.request import LoRARequest
from tests.core.fake import FakeRunner, make_request, make_scheduler, run_to_completion


def _lora_request(rid, lora_id, arrival, n_out=4):
    r = make_request(rid, [5, 6, 7, 8, 9], arrival=arrival, max_tokens=n_out, ignore_eos=True)
    if lora_id:
        r.lora_request = LoRARequest(f"a{lora_id}", lora_id, "/x")
        r.lora_int_id = lora_id
    return r


def test_at_most_max_loras_adapters_per_step_and_no_starvation():
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    sched.max_loras = 2
    # adapters 1 and 2 first, then 3 (no room), then more of 1 and 2 and a base request
    order = [(1, 1), (2, 2), (3, 3), (4, 1), (5, 2), (6, 0), (7, 1)]
    for arrival, (rid, lora) in enumerate(order):
        sched.add_request(_lora_request(rid, lora, arrival, n_out=6 if rid < 3 else 2))
    steps = []
    lora_of = {str(r): lora for r, lora in order}

    def on_step(so):
        loras = {lora_of[r] for r in so.num_scheduled_tokens} - {0}
        steps.append((set(so.num_scheduled_tokens), loras))

    outputs = run_to_completion(sched, FakeRunner(), on_step=on_step)
    assert set(outputs) == {str(r) for r, _ in order}  # every request finished
    assert all(len(loras) <= 2 for _, loras in steps)
    first = steps[0][0]
    # request 3 found no room: the later requests of adapters 1 and 2 waited behind it (no
    # starvation), the base request 6 did not
    assert first == {"1", "2", "6"}
    started = {}
    for i, (ids, _) in enumerate(steps):
        for r in ids:
            started.setdefault(r, i)
    assert started["3"] <= min(started["4"], started["5"], started["7"])
    assert started["3"] > 0
