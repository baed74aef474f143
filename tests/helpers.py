"""Shared test helpers: run a jaxinfer model on explicit paged-KV steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.runner.kv_cache import allocate_kv_caches
from jaxinfer.runner.step_inputs import make_step_inputs


@jax.jit
def _forward_all_logits(graphdef, state, kv_caches, input_ids, positions, md):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(input_ids, positions, kv_caches, md)
    return model.compute_logits(hidden), kv_caches


class PagedRunner:
    """Feeds chunks of several sequences through the model with a paged cache.

    Each sequence gets consecutive fresh blocks; `step` takes {seq: new_token_ids} and returns
    {seq: logits [len(new), V]} (numpy float32).
    """

    def __init__(self, model, *, num_blocks=64, block_size=4, max_blocks=16, dtype=jnp.float32):
        self.graphdef, self.state = nnx.split(model)
        self.block_size, self.max_blocks = block_size, max_blocks
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, dtype)
        self.next_block = 1  # block 0 is the null block
        self.tables: dict[object, list[int]] = {}
        self.computed: dict[object, int] = {}

    def _ensure_blocks(self, seq, total_len):
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < total_len:
            table.append(self.next_block)
            self.next_block += 1

    def step(self, work: dict, *, pad_tokens: int = 3, pad_reqs: int = 1):
        seqs = list(work)
        for s in seqs:
            self._ensure_blocks(s, self.computed.get(s, 0) + len(work[s]))
        num_tokens = sum(len(work[s]) for s in seqs)
        inp = make_step_inputs(
            [work[s] for s in seqs], [self.computed.get(s, 0) for s in seqs],
            [self.tables[s] for s in seqs], block_size=self.block_size,
            num_tokens_padded=num_tokens + pad_tokens, num_reqs_padded=len(seqs) + pad_reqs,
            max_blocks=self.max_blocks,
        )
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(inp.slot_mapping), block_tables=jnp.asarray(inp.block_tables),
            seq_lens=jnp.asarray(inp.seq_lens), query_start_loc=jnp.asarray(inp.query_start_loc),
            num_seqs=jnp.asarray(inp.num_seqs),
        )
        logits, self.kv_caches = _forward_all_logits(
            self.graphdef, self.state, self.kv_caches, jnp.asarray(inp.input_ids),
            jnp.asarray(inp.positions), md,
        )
        logits = np.asarray(logits)
        out = {}
        for i, s in enumerate(seqs):
            lo, hi = inp.query_start_loc[i], inp.query_start_loc[i + 1]
            out[s] = logits[lo:hi]
            self.computed[s] = self.computed.get(s, 0) + len(work[s])
        return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


class LiveServer:
    """An OpenAIServer on a free 127.0.0.1 port, served by uvicorn in a thread."""

    def __init__(self, llm, model_name: str, log_level: str = "warning"):
        import socket
        import threading
        import time

        import uvicorn

        from jaxinfer.entrypoints.openai.api_server import OpenAIServer

        self.server = OpenAIServer(llm, model_name)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._uv = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1", port=port,
                                                 log_level=log_level))
        self._thread = threading.Thread(target=self._uv.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._uv.started:
            if time.time() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self._uv.should_exit = True
        self._thread.join(timeout=10)
        self.server.llm.shutdown()
