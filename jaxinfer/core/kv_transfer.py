"""The scheduler's side of a KV connector's loads: starting a waiting request's load of its
prompt KV from elsewhere (it then waits in WAITING_FOR_REMOTE_KVS with its blocks), and the
worker side's reports of loads done or failed and blocks sent. Functions of the Scheduler `s`
(core/scheduler.py), kept apart from its step loop."""

from __future__ import annotations

from jaxinfer.request import Request, RequestStatus


def start_kv_load(s, request: Request, hit_blocks, num_hit: int) -> int | None:
    """Ask the connector for the prompt KV past the local prefix hits. Returns 0 when a
    load started (the request now waits in WAITING_FOR_REMOTE_KVS with its blocks),
    None when there is no room for its blocks (stop admitting); -1: nothing to load,
    admit it as usual."""
    n_ext, load_async = s.kv_connector.get_num_new_matched_tokens(request, num_hit)
    if n_ext is None:
        return 0  # the connector cannot tell yet: ask again next step
    request.kv_load_tried = True
    if not n_ext:
        return -1
    if not load_async:
        raise RuntimeError("KV connectors must load asynchronously in jaxinfer")
    blocks = s.kv.allocate_slots(request, 0, num_hit, hit_blocks,
                                 num_external_computed_tokens=n_ext, delay_cache_blocks=True)
    if blocks is None:
        request.kv_load_tried = False  # ask again when blocks are free
        return None
    s.kv_connector.update_state_after_alloc(
        request, s.kv.get_block_ids(request.request_id), n_ext)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    request.num_local_hit_tokens = num_hit
    request.num_computed_tokens = 0  # set when the KV has arrived
    request.num_external_tokens = n_ext
    return 0


def apply_connector_output(s, out) -> None:
    """The worker side's news, for the scheduler `s`: loads that arrived (the request waits
    for its turn with its KV computed) or failed (per kv_load_failure_policy: fail it, or
    recompute it from a fresh start), blocks sent (their delayed free)."""
    s.kv_connector.update_connector_output(out)
    for rid in out.finished_recving:
        request = s.requests.get(rid)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        n = request.num_local_hit_tokens + request.num_external_tokens
        request.num_computed_tokens = n
        s.num_kv_loaded_tokens += request.num_external_tokens
        s.kv.cache_blocks(request, n)
        request.status = RequestStatus.WAITING
    for rid, reason in out.failed_recving.items():
        request = s.requests.get(rid)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        s.num_kv_load_failures += 1
        if s.kv_load_failure_policy == "fail":
            s.waiting.remove(request)
            s._fail_request(request, reason)
            continue
        # Recompute: back to a fresh waiting request (its blocks go back; the failed
        # load never writes them), admitted again with a new prefix-cache lookup.
        s.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
    s.finish_delayed_free(out.finished_sending)
