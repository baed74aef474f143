"""The runner's persistent host state: one slot per live request (numpy, updated by diffs)."""

from __future__ import annotations

import numpy as np

from jaxinfer.outputs import NewRequestData


class InputBatch:
    """Token ids, block table and sampling parameters of every request the runner holds."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 logits_processors=(), window: bool = False):
        """window: the model's sliding layers have a pool of their own (a second table)."""
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), np.int32)  # [S, L+1]
        # Tokens per slot, counting the ones sampled by steps still in flight (their ids are
        # written into token_ids when the step is collected; `pending` counts them). The
        # scheduler counts the same tokens (Request.num_output_placeholders) for another
        # purpose: not to schedule past max_tokens; here they say which input ids are not on
        # the host yet (the step reads them on the device). Different facts, both needed.
        self.num_tokens = np.zeros(max_num_reqs, np.int32)
        self.pending = np.zeros(max_num_reqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        # Tokens whose KV is computed before the step being built: the scheduler's count,
        # brought by each step's diff (NewRequestData / CachedRequestData).
        self.num_computed = np.zeros(max_num_reqs, np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), np.int32)  # [S, B]
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        self.window_block_table = (np.zeros((max_num_reqs, max_blocks_per_req), np.int32)
                                   if window else None)
        self.num_window_blocks = np.zeros(max_num_reqs, np.int32)
        self.temperature = np.zeros(max_num_reqs, np.float32)
        self.top_k = np.zeros(max_num_reqs, np.int32)
        self.top_p = np.ones(max_num_reqs, np.float32)
        self.min_p = np.zeros(max_num_reqs, np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, np.float32)
        self.uses_penalties = np.zeros(max_num_reqs, bool)  # SamplingParams.uses_penalties
        self.seed = np.zeros(max_num_reqs, np.uint32)
        self.num_logprobs = np.full(max_num_reqs, -1, np.int32)  # -1: not requested
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, np.int32)
        self.needs_reset = np.zeros(max_num_reqs, bool)  # penalty state to clear next step
        # logit_bias of the slots that have one: (token ids int32, values float32)
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.num_logit_bias = np.zeros(max_num_reqs, np.int32)
        # Custom logits processors: each one's row per slot and whether the slot uses it.
        self.logits_processors = tuple(logits_processors)
        self.lp_rows = tuple(np.zeros((max_num_reqs, *p.row_shape), p.row_dtype)
                             for p in self.logits_processors)
        self.lp_active = tuple(np.zeros(max_num_reqs, bool) for _ in self.logits_processors)
        self.uses_processor = np.zeros(max_num_reqs, bool)
        self.lora_id = np.zeros(max_num_reqs, np.int64)  # the slot's adapter (0: none)
        self.req_id_to_slot: dict[str, int] = {}
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData) -> int:
        if not self._free_slots:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_reqs} live requests")
        s = self._free_slots.pop()
        self.req_id_to_slot[new.req_id] = s
        n = len(new.token_ids)
        self.token_ids[s, :n] = new.token_ids
        self.num_tokens[s] = n
        self.pending[s] = 0
        self.num_prompt_tokens[s] = new.num_prompt_tokens
        self.num_computed[s] = new.num_computed_tokens
        self.num_blocks[s] = 0
        # Entries past the request's blocks point at the null block, never at a block of the
        # slot's previous request (a draft model's lookahead writes may land there).
        self.block_table[s] = 0
        self.append_blocks(s, new.block_ids)
        if self.window_block_table is not None:
            self.window_block_table[s] = 0
            self.num_window_blocks[s] = 0
            self.append_window_blocks(s, new.window_block_ids)
        p = new.sampling_params
        self.temperature[s] = p.temperature
        self.top_k[s] = p.top_k if p.top_k > 0 else 0
        self.top_p[s] = p.top_p
        self.min_p[s] = p.min_p
        self.repetition_penalty[s] = p.repetition_penalty
        self.frequency_penalty[s] = p.frequency_penalty
        self.presence_penalty[s] = p.presence_penalty
        self.uses_penalties[s] = p.uses_penalties
        self.seed[s] = new.sampling_seed & 0xFFFFFFFF
        self.num_logprobs[s] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[s] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.needs_reset[s] = True
        self.logit_bias.pop(s, None)
        self.num_logit_bias[s] = 0
        if p.logit_bias:
            self.logit_bias[s] = (np.fromiter(p.logit_bias.keys(), np.int32),
                                  np.fromiter(p.logit_bias.values(), np.float32))
            self.num_logit_bias[s] = len(p.logit_bias)
        self.uses_processor[s] = False
        self.lora_id[s] = new.lora_int_id
        for proc, rows, active in zip(self.logits_processors, self.lp_rows, self.lp_active):
            row = proc.row(p)
            active[s] = row is not None
            if row is not None:
                rows[s] = row
                self.uses_processor[s] = True
        return s

    def remove(self, req_id: str) -> None:
        s = self.req_id_to_slot.pop(req_id, None)
        if s is not None:
            self._free_slots.append(s)

    def append_blocks(self, slot: int, block_ids) -> None:
        n0 = self.num_blocks[slot]
        self.block_table[slot, n0 : n0 + len(block_ids)] = block_ids
        self.num_blocks[slot] = n0 + len(block_ids)

    def append_window_blocks(self, slot: int, block_ids) -> None:
        """The sliding layers' pool: blocks appended to the slot's second table (the entries
        of blocks the scheduler freed keep their old ids: those keys are out of every query's
        window, masked, never read into an output)."""
        n0 = self.num_window_blocks[slot]
        self.window_block_table[slot, n0 : n0 + len(block_ids)] = block_ids
        self.num_window_blocks[slot] = n0 + len(block_ids)
