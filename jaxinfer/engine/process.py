"""Child processes with a lifeline: `python -m module` started with a pickled payload on its
stdin, which stays open while the parent lives (engine-core processes, the launcher's API
servers)."""

from __future__ import annotations

import os
import threading


def spawn_python(module: str, payload, env: dict[str, str] | None = None, pass_fds=()):
    """Start `python -m module` (a fresh interpreter: no fork of a JAX process, and no
    `if __name__ == "__main__"` guard needed in the user's script) with `payload` pickled on
    its stdin, which stays open as its lifeline: when this process goes, so does the child
    (read_lifeline_payload)."""
    import pickle
    import subprocess
    import sys

    import jaxinfer  # the child imports this very jaxinfer, wherever the parent found it

    env = {**os.environ, **(env or {})}
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxinfer.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env,
                            pass_fds=pass_fds)
    data = pickle.dumps(payload)
    proc.stdin.write(len(data).to_bytes(8, "little") + data)
    proc.stdin.flush()
    return proc


def read_lifeline_payload():
    """The child's side of spawn_python: the payload, and a thread that exits the process
    when stdin closes (the parent is gone)."""
    import pickle
    import sys

    stdin = sys.stdin.buffer
    size = int.from_bytes(stdin.read(8), "little")
    payload = pickle.loads(stdin.read(size))

    def watch_parent():
        while stdin.read(4096):
            pass
        os._exit(1)

    threading.Thread(target=watch_parent, name="jaxinfer-watch", daemon=True).start()
    return payload


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
