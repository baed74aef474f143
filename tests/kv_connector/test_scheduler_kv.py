"""The scheduler's side of KV connectors, with a scripted connector (block_size 4): a
request whose KV comes from elsewhere waits in WAITING_FOR_REMOTE_KVS with its blocks, keeps
its place without holding up the others, resumes with only its tail to compute; failed loads
recompute or fail; aborts while loading cancel the load and free the blocks at once."""

from __future__ import annotations

from jaxinfer.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput,
                                        KVConnectorScheduler)
from jaxinfer.request import FinishReason, RequestStatus
from tests.core.fake import FakeRunner, make_request, make_scheduler


class Scripted(KVConnectorScheduler):
    """Offers `offer[rid]` external tokens (None: "ask me later" once)."""

    def __init__(self, offer):
        super().__init__(None, 4)
        self.offer = dict(offer)
        self.allocated, self.finished, self.asked = {}, [], []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asked.append(request.request_id)
        n = self.offer.get(request.request_id, 0)
        if n is None:
            self.offer[request.request_id] = 8
            return None, False
        return n, n > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)

    def build_connector_meta(self):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return False, None


def _step(s, runner):
    so = s.schedule()
    return so, s.update_from_output(so, runner.execute(so))


def test_remote_kv_wait_resume_and_the_tail_computed():
    conn = Scripted({"a": 8})
    s = make_scheduler(num_blocks=40)
    s.kv_connector = conn
    s.add_request(make_request("a", range(100, 110), max_tokens=2))  # 10 tokens
    s.add_request(make_request("b", range(200, 205), max_tokens=2))
    runner = FakeRunner()
    so, _ = _step(s, runner)
    a = s.requests["a"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(so.num_scheduled_tokens) == ["b"]  # b is not held up behind a
    blocks, n_ext = conn.allocated["a"]
    assert n_ext == 8 and len(blocks) == 2 and s.kv.get_block_ids("a") == blocks
    assert [r.request_id for r in s.waiting] == ["a"]
    so, _ = _step(s, runner)  # still loading
    assert "a" not in so.num_scheduled_tokens
    s.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 8
    assert s.kv.num_cached_blocks["a"] == 2  # published once arrived
    so, _ = _step(s, runner)
    assert so.num_scheduled_tokens["a"] == 2  # only the tail
    (new,) = [n for n in so.scheduled_new_reqs if n.req_id == "a"]
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == tuple(blocks)
    while s.has_unfinished_requests():
        _step(s, runner)
    assert s.kv.get_num_free_blocks() == 39 and conn.asked.count("a") == 1


def test_ask_again_later_and_failures():
    conn = Scripted({"a": None, "b": 8, "c": 4})
    s = make_scheduler(num_blocks=40)
    s.kv_connector = conn
    for rid in "abc":
        s.add_request(make_request(rid, range(100, 110), max_tokens=2, cache_salt=rid))
    runner = FakeRunner()
    _step(s, runner)  # a: "later"; b, c: loading
    assert s.requests["a"].status == RequestStatus.WAITING and conn.asked.count("a") == 1
    _step(s, runner)  # a asked again: now loading too
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    free = s.kv.get_num_free_blocks()
    # b fails (recompute): its blocks go back, it starts over with a fresh lookup.
    s.update_connector_output(KVConnectorOutput(failed_recving={"b": "KV load failed: x"}))
    b = s.requests["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.kv.get_num_free_blocks() == free + 2
    so, _ = _step(s, runner)
    assert so.num_scheduled_tokens["b"] == 10 and conn.asked.count("b") == 1
    # c fails under policy "fail": finished with the error, blocks back.
    s.kv_load_failure_policy = "fail"
    s.update_connector_output(KVConnectorOutput(failed_recving={"c": "KV load failed: y"}))
    (out,) = s.take_extra_outputs()
    assert out.request_id == "c" and out.finish_reason == FinishReason.ABORT
    assert out.stop_reason == "KV load failed: y" and "c" not in s.requests
    # a is aborted while loading: the connector hears of it, the blocks are free at once.
    s.finish_requests(["a"])
    assert "a" in conn.finished and s.kv.get_block_ids("a") == []
    while s.has_unfinished_requests():
        _step(s, runner)
    assert s.kv.get_num_free_blocks() == 39


def test_no_room_for_the_load_stops_admission_and_retries():
    conn = Scripted({"a": 36})
    s = make_scheduler(num_blocks=12, max_model_len=44)  # 11 usable blocks
    s.kv_connector = conn
    s.add_request(make_request("x", range(300, 332), max_tokens=4))  # takes 9 blocks
    s.add_request(make_request("a", range(100, 140), max_tokens=2))
    runner = FakeRunner()
    _step(s, runner)
    assert s.requests["a"].status == RequestStatus.WAITING and "a" not in conn.allocated
    while "x" in s.requests:
        _step(s, runner)
    _step(s, runner)
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    while s.has_unfinished_requests():
        _step(s, runner)
    assert s.kv.get_num_free_blocks() == 11


def test_jax_transfer_consumer_releases_the_producer_when_aborted_before_admission():
    """A decode request aborted while still queued (never asked to pull) sends the producer
    its "done" notice, so the producer need not wait for abort_timeout."""
    from jaxinfer.config import KVTransferConfig
    from jaxinfer.kv_connector.jax_transfer import JaxTransferScheduler
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.request import Request

    class W:
        transfer_address, notify_address = "127.0.0.1:1", "tcp://127.0.0.1:2"

    conn = JaxTransferScheduler(KVTransferConfig("JaxTransferConnector", "kv_consumer"), 4,
                                "d0", W())
    s = make_scheduler(num_blocks=40, max_num_seqs=1)
    s.kv_connector = conn
    ktp = {"do_remote_prefill": True, "remote_num_blocks": 2, "remote_uuid": 77,
           "remote_host": "127.0.0.1:9", "remote_notify": "tcp://127.0.0.1:9", "block_size": 4}
    s.add_request(make_request("busy", range(300, 310), max_tokens=5))
    s.add_request(Request("q", list(range(100, 110)), SamplingParams(
        max_tokens=2, extra_args={"kv_transfer_params": ktp})))
    s.schedule()  # "busy" takes the only seat; "q" waits, never asked
    assert not s.requests["q"].kv_load_tried
    s.finish_requests(["q"])
    meta = conn.build_connector_meta()
    assert meta.notices == ({"notify": "tcp://127.0.0.1:9", "uuid": 77},) and not meta.loads
