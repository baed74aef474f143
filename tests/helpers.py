"""Shared test helpers: run a jaxinfer model on explicit paged-KV steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.runner.kv_cache import allocate_kv_caches
from jaxinfer.runner.step_inputs import empty_step_batch, fill_step_inputs


@jax.jit
def _forward_all_logits(graphdef, state, kv_caches, input_ids, positions, md):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(input_ids, positions, kv_caches, md)
    return model.compute_logits(hidden), kv_caches


class PagedRunner:
    """Feeds chunks of several sequences through the model with a paged cache, building each
    step with the production builder (step_inputs.fill_step_inputs).

    Each sequence gets consecutive fresh blocks; `step` takes {seq: new_token_ids} and returns
    {seq: logits [len(new), V]} (numpy float32).
    """

    def __init__(self, model, *, num_blocks=64, block_size=4, max_blocks=16, dtype=jnp.float32,
                 max_len=256, max_seqs=16):
        self.graphdef, self.state = nnx.split(model)
        self.block_size, self.max_blocks = block_size, max_blocks
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, dtype)
        self.next_block = 1  # block 0 is the null block
        self.slot: dict[object, int] = {}
        self.token_ids = np.zeros((max_seqs, max_len), np.int32)  # [S, L] like InputBatch's
        self.block_table = np.zeros((max_seqs, max_blocks), np.int32)
        self.num_blocks = np.zeros(max_seqs, np.int32)
        self.computed = np.zeros(max_seqs, np.int32)

    def _ensure_blocks(self, s, total_len):
        while self.num_blocks[s] * self.block_size < total_len:
            self.block_table[s, self.num_blocks[s]] = self.next_block
            self.num_blocks[s] += 1
            self.next_block += 1

    def step(self, work: dict, *, pad_tokens: int = 3, pad_reqs: int = 1):
        # Single-token sequences first, as the production runner lays them out.
        seqs = sorted(work, key=lambda s: len(work[s]) != 1)
        for seq in seqs:
            s = self.slot.setdefault(seq, len(self.slot))
            c = self.computed[s]
            self.token_ids[s, c : c + len(work[seq])] = work[seq]
            self._ensure_blocks(s, c + len(work[seq]))
        slots = np.array([self.slot[q] for q in seqs], np.int32)
        q_lens = np.array([len(work[q]) for q in seqs], np.int32)
        batch = empty_step_batch(int(q_lens.sum()) + pad_tokens, len(seqs) + pad_reqs,
                                 self.max_blocks, len(self.token_ids))
        fill_step_inputs(batch, self.token_ids, self.block_table, slots, self.computed[slots],
                         q_lens, self.block_size)
        logits, self.kv_caches = _forward_all_logits(
            self.graphdef, self.state, self.kv_caches, jnp.asarray(batch.input_ids),
            jnp.asarray(batch.positions), jax.device_put(batch.attn),
        )
        logits = np.asarray(logits)
        qsl = batch.attn.query_start_loc
        out = {}
        for i, seq in enumerate(seqs):
            out[seq] = logits[qsl[i] : qsl[i + 1]]
            self.computed[self.slot[seq]] += len(work[seq])
        return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


class LiveServer:
    """An OpenAIServer on a free 127.0.0.1 port, served by uvicorn in a thread."""

    def __init__(self, llm, model_name: str, log_level: str = "warning", **server_kwargs):
        import socket
        import threading
        import time

        import uvicorn

        from jaxinfer.entrypoints.openai.api_server import OpenAIServer

        self.server = OpenAIServer(llm, model_name, **server_kwargs)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._uv = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1", port=port,
                                                 log_level=log_level,
                                                 timeout_graceful_shutdown=10))
        self.server.uvicorn_server = self._uv  # (it exits when the engine dies, as in serve)
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
