"""Helpers for host-core tests: requests and a fake model runner."""

from __future__ import annotations

from jaxinfer.config import SchedulerConfig
from jaxinfer.core.kv_cache_manager import KVCacheManager
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.outputs import RunnerOutput, SchedulerOutput
from jaxinfer.request import Request
from jaxinfer.sampling_params import SamplingParams

EOS = 2


def make_request(rid, prompt, *, priority=0, arrival=None, eos=EOS, cache_salt=None, **params):
    params.setdefault("max_tokens", 16)
    return Request(str(rid), list(prompt), SamplingParams(**params), eos_token_id=eos,
                   arrival_time=float(arrival if arrival is not None else 0.0),
                   priority=priority, cache_salt=cache_salt)


def make_scheduler(*, num_blocks=64, block_size=4, max_model_len=64, caching=True, **cfg):
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, **cfg), kv)


class FakeRunner:
    """Samples `next_token(req_id, num_tokens_so_far)` for every request that completed its
    known tokens this step, like the real runner (partial prefills sample nothing)."""

    def __init__(self, next_token=lambda rid, n: 1000 + n):
        self.next_token = next_token
        self.num_tokens: dict[str, int] = {}  # runner-side view: tokens known per request
        self.computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.num_tokens.pop(rid, None)
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] += n
            assert self.computed[rid] <= self.num_tokens[rid], (rid, self.computed, n)
            ids.append(rid)
            if self.computed[rid] == self.num_tokens[rid]:
                tok = self.next_token(rid, self.num_tokens[rid])
                sampled.append((tok,))
                self.num_tokens[rid] += 1
            else:
                sampled.append(())
        return RunnerOutput(req_ids=tuple(ids), sampled_token_ids=tuple(sampled))


def run_to_completion(sched, runner, max_steps=10_000, on_step=None):
    outputs = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        so = sched.schedule()
        ro = runner.execute(so)
        for o in sched.update_from_output(so, ro):
            outputs.setdefault(o.request_id, []).append(o)
        if on_step:
            on_step(so)
    raise AssertionError("requests did not finish")
