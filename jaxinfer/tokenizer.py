"""A light tokenizer over HF `tokenizer.json` + `tokenizer_config.json` (no transformers import).

transformers' AutoTokenizer pulls torch in when it is installed (seconds of start-up, and the
engine must not depend on torch), so the engine reads the same files with `tokenizers` and
renders chat templates with jinja2, as transformers does.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer as _Tk

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: the model folder needs a tokenizer.json")
        self._tk = _Tk.from_file(path)
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        cfg: dict[str, Any] = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.pad_token = _token_content(cfg.get("pad_token"))
        self.chat_template = cfg.get("chat_template")
        template_file = os.path.join(model_dir, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(template_file):
            with open(template_file) as f:
                self.chat_template = f.read()
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self._special_ids = {t.content and self._tk.token_to_id(t.content)
                             for t in self._tk.get_added_tokens_decoder().values() if t.special}

    @staticmethod
    def from_pretrained(model_dir: str) -> "Tokenizer":
        return Tokenizer(model_dir)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text (for grammar backends)."""
        return self._tk.to_str()

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tk.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary string is at least as
        long): a text of N characters has at least N / max_token_chars tokens."""
        if getattr(self, "_max_token_chars", None) is None:
            vocab = self._tk.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(k) for k in vocab), default=1)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        """The vocabulary's strings of the ids (as transformers' tokenizers)."""
        return [self._tk.id_to_token(int(i)) or "" for i in ids]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(self, conversation: list[dict[str, Any]], *,
                            chat_template: str | None = None, tokenize: bool = True,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs):
        """Render with the model's (or the given) jinja template, as transformers does.
        continue_final_message: the text ends right after the last message's content (no
        end-of-turn after it), for the model to continue it."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template; pass chat_template=")
        text = _compile(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        if continue_final_message:
            final = conversation[-1].get("content") if conversation else ""
            if isinstance(final, list):  # content parts: the last one's text
                final = final[-1].get("text") if final else ""
            final = final or ""
            if final and final in text:
                text = text[: text.rindex(final) + len(final)]
            elif final.strip() and final.strip() in text:
                text = text[: text.rindex(final.strip()) + len(final.strip())]
            else:
                raise ValueError("continue_final_message: the final message does not appear "
                                 "in the rendered chat (the template changes or drops it)")
        # The template already placed any BOS: do not add special tokens again.
        return self.encode(text, add_special_tokens=False) if tokenize else text


_TEMPLATES: dict[str, Any] = {}


def _compile(template: str):
    if template not in _TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template error: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]
