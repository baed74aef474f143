"""Prometheus collectors under vLLM's V1 metric names (`vllm:` prefix, labels `model_name` and
`engine`, vLLM's histogram buckets), so that vLLM's Grafana dashboard and alert rules work
unchanged; the few series vLLM has no counterpart for (data-parallel routing, engine liveness,
KV-connector transfers) are ours, under `jaxinfer:`."""

from __future__ import annotations

import time

from jaxinfer.outputs import RequestOutput

# vLLM's bucket families (vllm/v1/metrics/buckets.py, 0.32).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    """Prometheus collectors, fed from the engine thread after every step.

    `engine` is the data-parallel rank: scheduler gauges and counters per rank (from each
    rank's stats), request series under the rank that served the request.

    role "only": one API server, its own registry. With several API servers ("primary",
    "secondary"; PROMETHEUS_MULTIPROC_DIR set by the launcher before prometheus_client is
    imported), every process writes its values to files there and /metrics on any of them
    adds them up (request counters and histograms summed over the servers); the gauges and
    counters that mirror engine-core stats are fed by the primary only, which sees the same
    engines as the others."""

    def __init__(self, model_name: str, role: str = "only", max_model_len: int = 2048,
                 cache_config: dict | None = None, num_engines: int = 1):
        import functools

        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client import Gauge as _Gauge

        self.role = role
        self.feeds_engine_stats = role != "secondary"
        # (one writer per gauge across the processes: report its latest value)
        Gauge = functools.partial(_Gauge, multiprocess_mode="mostrecent")
        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        self._lbl = {"model_name": model_name}
        names = ["model_name", "engine"]
        v = "vllm:"

        plain = []  # the series labelled (model_name, engine) only: each engine's shown at 0

        def made(metric, extra):
            if not extra:
                plain.append(metric)
            return metric

        def gauge(name, doc, extra=()):
            return made(Gauge(v + name, doc, names + list(extra), registry=reg), extra)

        def counter(name, doc, extra=(), prefix=v):
            return made(Counter(prefix + name, doc, names + list(extra), registry=reg), extra)

        def histogram(name, doc, buckets):
            return made(Histogram(v + name, doc, names, buckets=buckets, registry=reg), ())

        # -- scheduler state (per engine, from its stats) --
        self.running = gauge("num_requests_running", "Number of requests in model execution "
                             "batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be "
                             "processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                              "usage.")
        self.sleep_state = gauge("engine_sleep_state", "Engine sleep state; awake = 0 means "
                                 "engine is sleeping; awake = 1 means engine is awake; "
                                 "weights_offloaded = 1 means sleep level 1; discard_all = 1 "
                                 "means sleep level 2.", ["sleep_state"])
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms "
                                      "of number of queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number "
                                   "of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from "
                                   "the engine.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft "
                                         "tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted "
                                     "tokens.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.",
                                             ["position"])
        # -- tokens and requests (per engine, from the outputs) --
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Number of cached prompt "
                                            "tokens (local + external).")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens "
                                         "processed.")
        self.request_success = counter("request_success", "Count of successfully processed "
                                       "requests.", ["finished_reason"])
        tok = request_tokens_buckets(max_model_len)
        self.req_prompt = histogram("request_prompt_tokens", "Number of prefill tokens "
                                    "processed.", tok)
        self.req_gen = histogram("request_generation_tokens", "Number of generation tokens "
                                 "processed.", tok)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of "
                                          "tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.req_max_gen = histogram("request_max_num_generation_tokens", "Histogram of "
                                     "maximum number of requested generation tokens.", tok)
        self.req_n = histogram("request_params_n", "Histogram of the n request parameter.",
                               REQUEST_PARAMS_N_BUCKETS)
        self.req_max_tokens = histogram("request_params_max_tokens", "Histogram of the "
                                        "max_tokens request parameter.", tok)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first "
                              "token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency "
                             "in seconds.", INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Histogram of "
                              "time_per_output_token_seconds per request.",
                              INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency "
                             "in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Histogram of time spent in "
                                    "WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Histogram of time "
                                        "spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Histogram of time "
                                      "spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Histogram of time spent "
                                     "in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.req_preemptions = histogram("request_num_preemptions", "Number of preemptions "
                                         "per finished request.",
                                         REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.req_kv_computed = histogram("request_prefill_kv_computed_tokens", "Histogram of "
                                         "new KV tokens computed during prefill (excluding "
                                         "cached tokens).", tok)
        # -- ours (no vLLM counterpart) --
        j = "jaxinfer:"
        self.kv_loaded = counter("kv_connector_loaded_tokens", "Prompt tokens whose KV a "
                                 "connector brought in.", prefix=j)
        self.kv_load_failures = counter("kv_connector_load_failures", "KV loads that failed "
                                        "or timed out.", prefix=j)
        self.kv_expired = counter("kv_connector_expired_sends", "Blocks held for a pull that "
                                  "nobody made (freed).", prefix=j)
        self.kv_held = made(Gauge(j + "kv_connector_blocks_held", "KV blocks of finished "
                                  "requests held for a transfer.", names, registry=reg), ())
        # Data parallelism / API-server scale-out (summed over API servers in multiprocess
        # mode): requests each engine core (data-parallel rank) was sent, requests each API
        # server took.
        self.dp_routed = counter("dp_requests_routed", "Requests sent to each data-parallel "
                                 "engine core.", prefix=j)
        self.api_requests = Counter(j + "api_server_requests", "Generation requests each API "
                                    "server took.", ["model_name", "api_server"], registry=reg)
        # 1 while an engine core (data-parallel rank) can serve, 0 once it is dead: a dead
        # engine shows here as well as in /health (503).
        self.engine_alive = Gauge(j + "engine_core_alive", "1 while the engine core serves, 0 "
                                  "when it is dead.", names, registry=reg)  # (set when known)
        if cache_config and self.feeds_engine_stats:
            info = Gauge(v + "cache_config_info", "Information of the LLMEngine CacheConfig",
                         sorted(cache_config) + ["engine"], registry=reg)
            for e in range(num_engines):
                info.labels(engine=str(e), **{k: str(x) for k, x in cache_config.items()}
                            ).set(1)
        for e in range(num_engines):  # (vLLM's: every engine's series from the start)
            for metric in plain:  # (gauges: only where they are fed, "mostrecent" wins)
                if self.feeds_engine_stats or not isinstance(metric, _Gauge):
                    metric.labels(**self._l(str(e)))
            if self.feeds_engine_stats:
                self._set_sleep(str(e), None)
        self._children: dict[tuple[int, str], object] = {}
        self._routed_seen: list[int] = []
        # request -> (tokens so far, last token time, engine label)
        self._seen: dict[str, tuple[int, float | None, str]] = {}
        self._last_stats: dict[str, dict] = {}  # engine label -> its stats at the last update

    def _l(self, engine: str, **extra) -> dict:
        return dict(self._lbl, engine=engine, **extra)

    def _at(self, metric, engine: str):
        """`metric`'s child for this engine, looked up once (labels() locks and checks: too
        slow for every output of every step)."""
        key = (id(metric), engine)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._l(engine))
        return child

    # -- per step -------------------------------------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], stats: dict) -> None:
        now = time.time()
        iteration: dict[str, int] = {}  # engine -> tokens of this step's outputs
        for out in outputs:
            m = out.metrics
            n = sum(len(c.token_ids) for c in out.outputs)
            prev_n, prev_t, engine = self._seen.get(out.request_id, (0, None, None))
            if engine is None:
                engine = str(m.engine_index if m is not None else 0)
            new = n - prev_n
            if prev_t is None and n > 0:
                if m is not None:
                    self._at(self.ttft, engine).observe(now - m.arrival_time)
                self._at(self.prompt_tokens, engine).inc(len(out.prompt_token_ids))
                self._at(self.prompt_tokens_cached, engine).inc(out.num_cached_tokens)
                iteration[engine] = iteration.get(engine, 0) + len(out.prompt_token_ids)
            elif new > 0 and prev_t is not None:
                self._at(self.itl, engine).observe(now - prev_t)
            if new > 0:
                self._at(self.generation_tokens, engine).inc(new)
                iteration[engine] = iteration.get(engine, 0) + new
                self._seen[out.request_id] = (n, now, engine)
            if out.finished:
                self._seen.pop(out.request_id, None)
                self._finished(out, n, now, engine)
        for engine, count in iteration.items():
            self._at(self.iteration_tokens, engine).observe(count)
        self.update_gauges(stats)

    def _finished(self, out: RequestOutput, n: int, now: float, engine: str) -> None:
        m = out.metrics
        self._at(self.req_prompt, engine).observe(len(out.prompt_token_ids))
        self._at(self.req_gen, engine).observe(n)
        self._at(self.req_max_gen, engine).observe(max((len(c.token_ids) for c in out.outputs),
                                                   default=0))
        self._at(self.req_kv_computed, engine).observe(
            max(len(out.prompt_token_ids) - out.num_cached_tokens, 0))
        for c in out.outputs:
            self.request_success.labels(finished_reason=c.finish_reason or "abort",
                                        **self._l(engine)).inc()
        if m is None:
            return
        self._at(self.e2e, engine).observe(now - m.arrival_time)
        self._at(self.req_n, engine).observe(m.n_param)
        if m.max_tokens_param is not None:
            self._at(self.req_max_tokens, engine).observe(m.max_tokens_param)
        self._at(self.req_preemptions, engine).observe(m.num_preemptions)
        scheduled = m.first_scheduled_time
        if scheduled is not None:
            self._at(self.queue_time, engine).observe(max(scheduled - m.arrival_time, 0.0))
        if scheduled is not None and m.first_token_time is not None:
            last = m.last_token_time or m.first_token_time
            self._at(self.prefill_time, engine).observe(max(m.first_token_time - scheduled, 0.0))
            self._at(self.inference_time, engine).observe(max(last - scheduled, 0.0))
            decode = max(last - m.first_token_time, 0.0)
            self._at(self.decode_time, engine).observe(decode)
            # (vLLM: requests with one output token or none count as zero)
            per_sample = max((len(c.token_ids) for c in out.outputs), default=0)
            self._at(self.tpot, engine).observe(decode / (per_sample - 1) if per_sample > 1
                                            else 0.0)

    def on_abort(self, request_id: str) -> None:
        """A live request was aborted (e.g. its client went away)."""
        _, _, engine = self._seen.pop(request_id, (0, None, "0"))
        self.request_success.labels(finished_reason="abort", **self._l(engine)).inc()

    def update_routing(self, num_routed: list[int]) -> None:
        seen = self._routed_seen + [0] * (len(num_routed) - len(self._routed_seen))
        for rank, (now, was) in enumerate(zip(num_routed, seen)):
            if now > was:
                self.dp_routed.labels(**self._l(str(rank))).inc(now - was)
        self._routed_seen = list(num_routed)

    def set_engine_alive(self, alive: list[bool]) -> None:
        if not self.feeds_engine_stats:
            return
        for rank, ok in enumerate(alive):
            self.engine_alive.labels(**self._l(str(rank))).set(1 if ok else 0)

    def _set_sleep(self, engine: str, level) -> None:
        """vLLM's three series: awake, weights_offloaded (level 1), discard_all (level 2)."""
        states = {"awake": level is None, "weights_offloaded": level == 1,
                  "discard_all": level == 2}
        for state, on in states.items():
            self.sleep_state.labels(sleep_state=state, **self._l(engine)).set(1 if on else 0)

    def update_gauges(self, stats: dict) -> None:
        """Scheduler gauges and counters per engine (data-parallel rank) from its stats."""
        if not self.feeds_engine_stats:
            return
        per_rank = stats.get("per_rank")
        if per_rank is None:
            per_rank, ranks = [stats], [0]
        else:
            ranks = stats.get("ranks") or list(range(len(per_rank)))
        for rank, st in zip(ranks, per_rank):
            self._update_engine(str(rank), st)

    def _update_engine(self, engine: str, stats: dict) -> None:
        self._at(self.running, engine).set(stats.get("num_running_reqs", 0))
        self._at(self.waiting, engine).set(stats.get("num_waiting_reqs", 0))
        self._at(self.kv_usage, engine).set(stats.get("kv_cache_usage", 0.0))
        self._at(self.kv_held, engine).set(stats.get("kv_connector_blocks_held", 0))
        self._set_sleep(engine, stats.get("sleep_level"))
        last = self._last_stats.get(engine, {})
        for key, counter in (("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits),
                             ("num_preemptions", self.preemptions),
                             ("spec_decode_num_drafts", self.spec_drafts),
                             ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_decode_num_accepted_tokens", self.spec_accepted),
                             ("kv_connector_loaded_tokens", self.kv_loaded),
                             ("kv_connector_load_failures", self.kv_load_failures),
                             ("kv_connector_expired_sends", self.kv_expired)):
            delta = stats.get(key, 0) - last.get(key, 0)
            if delta > 0:
                self._at(counter, engine).inc(delta)
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos:
            before = last.get("spec_decode_num_accepted_tokens_per_pos") or [0] * len(per_pos)
            for pos, (now, was) in enumerate(zip(per_pos, before)):
                if now > was:
                    self.spec_accepted_per_pos.labels(position=str(pos),
                                                    **self._l(engine)).inc(now - was)
        self._last_stats[engine] = dict(stats)

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        if self.role == "only":
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
