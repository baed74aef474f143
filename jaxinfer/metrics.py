"""Per-request timings and Prometheus collectors (vLLM's metric names, `jaxinfer:` prefix)."""

from __future__ import annotations

import time

from jaxinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class EngineMetrics:
    """Prometheus collectors, fed from the engine thread after every step.

    role "only": one API server, its own registry. With several API servers ("primary",
    "secondary"; PROMETHEUS_MULTIPROC_DIR set by the launcher before prometheus_client is
    imported), every process writes its values to files there and /metrics on any of them
    adds them up (request counters and histograms summed over the servers); the gauges and
    counters that mirror engine-core stats are fed by the primary only, which sees the same
    engines as the others."""

    def __init__(self, model_name: str, role: str = "only"):
        import functools

        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client import Gauge as _Gauge

        self.role = role
        self.feeds_engine_stats = role != "secondary"
        # (one writer per gauge across the processes: report its latest value)
        Gauge = functools.partial(_Gauge, multiprocess_mode="mostrecent")
        self.registry = CollectorRegistry()
        lbl = {"model_name": model_name}
        self._lbl = lbl
        names = ["model_name"]
        p = "jaxinfer:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running queue.",
                             names, registry=self.registry).labels(**lbl)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled.",
                             names, registry=self.registry).labels(**lbl)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use.",
                              names, registry=self.registry).labels(**lbl)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries (tokens) since start.", names,
                                     registry=self.registry).labels(**lbl)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prefix-cache queried tokens.",
                                      names, registry=self.registry).labels(**lbl)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prefix-cache hit tokens.", names,
                                   registry=self.registry).labels(**lbl)
        self.preemptions = Counter(p + "num_preemptions", "Preemptions (recompute).", names,
                                   registry=self.registry).labels(**lbl)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prefilled prompt tokens.", names,
                                     registry=self.registry).labels(**lbl)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", names,
                                         registry=self.registry).labels(**lbl)
        self.request_success = Counter(p + "request_success", "Finished requests by reason.",
                                       names + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token.", names,
                              buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**lbl)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Inter-token latency.", names,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**lbl)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency.",
                             names, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**lbl)
        self.req_prompt = Histogram(p + "request_prompt_tokens", "Prompt tokens per request.",
                                    names, buckets=_TOKEN_BUCKETS,
                                    registry=self.registry).labels(**lbl)
        self.req_gen = Histogram(p + "request_generation_tokens",
                                 "Generated tokens per request.", names, buckets=_TOKEN_BUCKETS,
                                 registry=self.registry).labels(**lbl)
        # Speculative decoding (vLLM's spec_decode_* names; zero when it is off).
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verify runs with drafts.",
                                   names, registry=self.registry).labels(**lbl)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens",
                                         "Draft tokens proposed and verified.", names,
                                         registry=self.registry).labels(**lbl)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.", names,
                                     registry=self.registry).labels(**lbl)
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.",
                                             names + ["position"], registry=self.registry)
        # KV connectors (zero without one).
        self.kv_loaded = Counter(p + "kv_connector_loaded_tokens",
                                 "Prompt tokens whose KV a connector brought in.", names,
                                 registry=self.registry).labels(**lbl)
        self.kv_load_failures = Counter(p + "kv_connector_load_failures",
                                        "KV loads that failed or timed out.", names,
                                        registry=self.registry).labels(**lbl)
        self.kv_expired = Counter(p + "kv_connector_expired_sends",
                                  "Blocks held for a pull that nobody made (freed).", names,
                                  registry=self.registry).labels(**lbl)
        self.kv_held = Gauge(p + "kv_connector_blocks_held",
                             "KV blocks of finished requests held for a transfer.", names,
                             registry=self.registry).labels(**lbl)
        # Data parallelism / API-server scale-out (summed over API servers in multiprocess
        # mode): requests each engine core (data-parallel rank) was sent, requests each API
        # server took.
        self.dp_routed = Counter(p + "dp_requests_routed",
                                 "Requests sent to each data-parallel engine core.",
                                 names + ["engine"], registry=self.registry)
        self.api_requests = Counter(p + "api_server_requests",
                                    "Generation requests each API server took.",
                                    names + ["api_server"], registry=self.registry)
        # 1 while an engine core (data-parallel rank) can serve, 0 once it is dead: a dead
        # engine shows here as well as in /health (503).
        self.engine_alive = Gauge(p + "engine_core_alive",
                                  "1 while the engine core serves, 0 when it is dead.",
                                  names + ["engine"], registry=self.registry)
        self._routed_seen: list[int] = []
        self._seen: dict[str, tuple[int, float]] = {}  # request -> (tokens so far, last time)
        self._last_stats: dict = {}

    def on_step(self, outputs: list[RequestOutput], stats: dict) -> None:
        now = time.time()
        for out in outputs:
            n = sum(len(c.token_ids) for c in out.outputs)
            prev_n, prev_t = self._seen.get(out.request_id, (0, None))
            if prev_t is None and n > 0:
                self.ttft.observe(now - out.metrics.arrival_time)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            elif n > prev_n and prev_t is not None:
                self.itl.observe((now - prev_t) / (n - prev_n))
            if n > prev_n:
                self.generation_tokens.inc(n - prev_n)
                self._seen[out.request_id] = (n, now)
            if out.finished:
                self._seen.pop(out.request_id, None)
                self.e2e.observe(now - out.metrics.arrival_time)
                self.req_prompt.observe(len(out.prompt_token_ids))
                self.req_gen.observe(n)
                for c in out.outputs:
                    self.request_success.labels(finished_reason=c.finish_reason or "abort",
                                                **self._lbl).inc()
        self.update_gauges(stats)

    def on_abort(self, request_id: str) -> None:
        """A live request was aborted (e.g. its client went away)."""
        self._seen.pop(request_id, None)
        self.request_success.labels(finished_reason="abort", **self._lbl).inc()

    def update_routing(self, num_routed: list[int]) -> None:
        seen = self._routed_seen + [0] * (len(num_routed) - len(self._routed_seen))
        for rank, (now, was) in enumerate(zip(num_routed, seen)):
            if now > was:
                self.dp_routed.labels(engine=str(rank), **self._lbl).inc(now - was)
        self._routed_seen = list(num_routed)

    def set_engine_alive(self, alive: list[bool]) -> None:
        if not self.feeds_engine_stats:
            return
        for rank, ok in enumerate(alive):
            self.engine_alive.labels(engine=str(rank), **self._lbl).set(1 if ok else 0)

    def update_gauges(self, stats: dict) -> None:
        if not self.feeds_engine_stats:
            return
        self.running.set(stats.get("num_running_reqs", 0))
        self.waiting.set(stats.get("num_waiting_reqs", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        self.prefix_hit_rate.set(stats.get("prefix_cache_hit_rate", 0.0))
        self.kv_held.set(stats.get("kv_connector_blocks_held", 0))
        last = self._last_stats
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
                counter.inc(delta)
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos:
            before = last.get("spec_decode_num_accepted_tokens_per_pos") or [0] * len(per_pos)
            for pos, (now, was) in enumerate(zip(per_pos, before)):
                if now > was:
                    self.spec_accepted_per_pos.labels(position=str(pos), **self._lbl).inc(
                        now - was)
        self._last_stats = dict(stats)

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        if self.role == "only":
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
