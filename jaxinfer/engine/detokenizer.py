"""Incremental detokenization and stop strings.

Text is decoded over a short sliding window of tokens (prefix_offset..read_offset is what was
already emitted) so byte-level BPE pieces that only form a character together, and multi-byte
UTF-8 split across tokens, never emit a replacement character: new text is taken only once the
window no longer ends in U+FFFD.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # tokens of the prompt used as left context for the first output token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool, min_tokens: int):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        ctx = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(ctx)
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.output_text = ""
        self.num_output_tokens = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, token_id: int) -> int:
        """Add one token; return how many characters were appended to output_text."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.output_text += new
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return len(new)
        return 0

    def update(self, new_token_ids, stop_terminated: bool) -> str | None:
        """Detokenize new tokens; return the stop string that ended the output, if any.

        When the engine stopped on EOS or a stop token id, that last token is not rendered.
        """
        ids = list(new_token_ids)
        if stop_terminated and ids:
            ids = ids[:-1]
        for tok in ids:
            added = self._append(tok)
            self.num_output_tokens += 1
            if self.stop and added and self.num_output_tokens > self.min_tokens:
                hit = self._check_stop_strings(added)
                if hit is not None:
                    return hit
        return None

    def _check_stop_strings(self, new_chars: int) -> str | None:
        text = self.output_text
        for stop_str in self.stop:
            # Only where the new characters could complete the stop string.
            start = max(len(text) - new_chars - len(stop_str) + 1, 0)
            idx = text.find(stop_str, start)
            if idx == -1:
                continue
            end = idx + len(stop_str) if self.include_stop else idx
            self.output_text = text[:end]
            return stop_str
        return None
