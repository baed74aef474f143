"""The data-parallel load balancer, as pure Python: spread, burst safety (local in-flight
counters, no stale-stats snowball), prefix affinity within a slack, dead ranks."""

from __future__ import annotations

import random

import pytest

from jaxinfer.engine.dp_client import DPLoadBalancer, _merge_stats
from jaxinfer.engine.messages import EngineDeadError


def test_200_requests_spread_evenly_with_random_finishes():
    lb = DPLoadBalancer(2, block_size=16, max_num_seqs=8)
    rng = random.Random(0)
    live, counts = [], [0, 0]
    for i in range(200):
        prompt = [rng.randrange(50000) for _ in range(rng.randrange(5, 200))]
        rank = lb.choose(f"r{i}", prompt)
        counts[rank] += 1
        live.append(f"r{i}")
        for _ in range(rng.randrange(3)):  # some finish meanwhile, in random order
            if live:
                lb.finished(live.pop(rng.randrange(len(live))))
        assert abs(lb.in_flight[0] - lb.in_flight[1]) <= max(2, lb.slack)
    assert all(abs(c - 100) <= 15 for c in counts), counts
    for rid in live:
        lb.finished(rid)
    assert lb.in_flight == [0, 0] and not lb.owner


def test_a_burst_between_stats_updates_is_split_exactly():
    """No finishes, no fresh stats: the local counters alone keep ranks within one."""
    lb = DPLoadBalancer(3, block_size=16, max_num_seqs=8, prefix_affinity=False)
    for i in range(31):
        lb.choose(f"r{i}", [i] * 40)
        assert max(lb.in_flight) - min(lb.in_flight) <= 1


def test_prefix_affinity_keeps_a_burst_on_one_rank_within_the_slack():
    lb = DPLoadBalancer(2, block_size=16, max_num_seqs=8)
    shared = list(range(100, 164))  # 4 full blocks
    lb.choose("other", [7] * 20)  # rank 0 busy with one request
    ranks = [lb.choose(f"s{i}", shared + [i]) for i in range(8)]
    assert len(set(ranks)) == 1 and lb.num_affinity_hits == 7
    # Past max_num_seqs more than the least loaded rank, the burst spills over.
    more = [lb.choose(f"t{i}", shared + [50 + i]) for i in range(4)]
    assert set(more) != {ranks[0]}
    # Off: the same burst alternates.
    lb2 = DPLoadBalancer(2, block_size=16, max_num_seqs=8, prefix_affinity=False)
    assert {lb2.choose(f"s{i}", shared + [i]) for i in range(4)} == {0, 1}
    # Prompts shorter than a block carry no affinity.
    assert lb2._prefix_key([1, 2, 3]) is None


def test_dead_rank_is_skipped_and_its_requests_reported():
    lb = DPLoadBalancer(2, block_size=4, max_num_seqs=8)
    for i in range(6):
        lb.choose(f"r{i}", [i] * 8)
    lost = lb.rank_died(1)
    assert len(lost) == 3 and all(lb.owner[r] == 0 for r in lb.owner)
    assert {lb.choose(f"n{i}", [9] * 8) for i in range(5)} == {0}
    lb.rank_died(0)
    with pytest.raises(EngineDeadError, match="every data-parallel engine core"):
        lb.choose("x", [1])


def test_stats_merge_sums_counts_and_keeps_ranks():
    a = {"num_running_reqs": 2, "num_waiting_reqs": 1, "kv_cache_usage": 0.5,
         "prefix_cache_queries": 100, "prefix_cache_hits": 50, "time": 1.0}
    b = {"num_running_reqs": 1, "num_waiting_reqs": 0, "kv_cache_usage": 0.1,
         "prefix_cache_queries": 100, "prefix_cache_hits": 0, "time": 2.0}
    m = _merge_stats([a, b])
    assert m["num_running_reqs"] == 3 and m["num_waiting_reqs"] == 1
    assert m["kv_cache_usage"] == pytest.approx(0.3)
    assert m["prefix_cache_hit_rate"] == 0.25 and m["time"] == 2.0
    assert m["per_rank"] == [a, b]


def test_other_front_ends_load_from_the_coordinator_steers_routing():
    """Two API servers share two ranks: this one's own counters are equal, but the other
    front end holds 6 requests on rank 0 (the coordinator's table), so new ones go to 1
    until the loads meet."""
    from jaxinfer.engine.coordinator import others_load

    lb = DPLoadBalancer(2, block_size=16, max_num_seqs=8, prefix_affinity=False)
    table = [[3, 3, 0.5, [2, 6]], [0, 0, 0.0, [0, 0]]]  # rows: waiting, running, kv, held
    lb.others = others_load(table, client_index=0)
    assert lb.others == [6, 0]
    picks = [lb.choose(f"r{i}", [i] * 20) for i in range(8)]
    assert picks[:6] == [1] * 6 and sorted(picks[6:]) == [0, 1]
    assert others_load([None, [0, 1, 0.1, [4, 5, 7]]], client_index=1) == [0, 11]


def test_coordinator_publishes_the_engines_table(tmp_path):
    import msgspec
    import zmq

    from jaxinfer.engine.coordinator import DPCoordinator

    stats, pub = f"ipc://{tmp_path}/stats", f"ipc://{tmp_path}/pub"
    coord = DPCoordinator(2, stats, pub).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    push = ctx.socket(zmq.PUSH)
    push.connect(stats)
    try:
        enc = msgspec.msgpack.Encoder()
        push.send(enc.encode((1, 2, 3, 0.25, [1, 4], [5, 9])))
        push.send(b"\x93garbage")  # a bad message is dropped, the coordinator goes on
        push.send(enc.encode((7, 0, 0, 0.0, [0, 0], [0, 0])))  # no such rank: ignored
        table = None
        for _ in range(50):  # published within ~100 ms of the change, and every second
            if sub.poll(200):
                table = msgspec.msgpack.decode(sub.recv())
                if table[1] is not None:
                    break
        assert table == [None, [2, 3, 0.25, [1, 4], [5, 9]]]
        assert coord.num_updates == 1
    finally:
        push.close(0)
        sub.close(0)
        ctx.term()
        coord.stop()
