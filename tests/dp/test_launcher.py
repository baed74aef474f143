"""The multi-process serve's pieces without a model: flag checks that name the flag, the
head's handshake for ranks on other nodes (spec, refusals, ping), the address plan."""

from __future__ import annotations

import argparse

import msgspec
import pytest
import zmq

from jaxinfer.entrypoints.cli import build_parser
from jaxinfer.entrypoints.launcher import Addresses, _Handshake, check_args, needs_launcher


def _args(*argv) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_which_layouts_need_the_launcher_and_bad_flags_are_named():
    assert not needs_launcher(_args("-dp", "2"))  # one front end starts its own ranks
    assert needs_launcher(_args("-dp", "2", "--api-server-count", "2"))
    assert needs_launcher(_args("-dp", "2", "-dpl", "1"))
    assert needs_launcher(_args("-dp", "2", "--headless", "-dpr", "1", "-dpl", "1"))
    assert needs_launcher(_args("-dp", "2", "--data-parallel-backend", "ray"))
    check_args(_args("-dp", "4", "--headless", "-dpr", "2", "-dpl", "2"))
    for argv, flag in ((["--api-server-count", "0"], "--api-server-count"),
                       (["-dp", "2", "--headless", "-dpr", "1", "-dpl", "2"],
                        "--data-parallel-start-rank"),
                       (["-dp", "2", "-dpl", "3"], "--data-parallel-size-local"),
                       (["-dp", "2", "-dpr", "1"], "--data-parallel-start-rank"),
                       (["--headless", "--data-parallel-backend", "ray"], "--headless")):
        with pytest.raises(ValueError, match=flag):
            check_args(_args(*argv))


def test_handshake_gives_remote_ranks_their_addresses_once(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addrs = Addresses(num_servers=2, num_ranks=3, tcp_host="127.0.0.1")
    hs = _Handshake("127.0.0.1", port, addrs, remote_ranks={1, 2})
    ctx = zmq.Context()

    def dealer():
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{port}")
        return d

    def ask(sock, msg):
        sock.send(msgspec.msgpack.encode(msg))
        assert sock.poll(5000)
        return msgspec.msgpack.decode(sock.recv())

    a, b = dealer(), dealer()
    try:
        spec = ask(a, {"hello": 1})["spec"]
        # Rank 1 connects to both API servers' sockets for rank 1, and to the coordinator.
        assert spec["inputs"] == [addrs.core_in[0][1][1], addrs.core_in[1][1][1]]
        assert spec["outputs"] == [addrs.core_out[0][1][1], addrs.core_out[1][1][1]]
        assert spec["coordinator"] == addrs.stats[1] and spec["inputs"][0].startswith("tcp://")
        assert "already" in ask(b, {"hello": 1})["error"]  # a second node claiming rank 1
        assert "not expected" in ask(b, {"hello": 0})["error"]  # the head's own rank
        assert "bad handshake" in ask(b, ["nonsense"])["error"]
        assert ask(b, {"ping": 2}) == {"pong": True}
        assert "spec" in ask(b, {"hello": 2})
    finally:
        a.close()
        b.close()
        ctx.term()
        hs.stop()
