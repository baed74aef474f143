"""Grammar backends behind one small interface (no hand-written regex/JSON machines here).

A backend turns a StructuredOutputsParams into a compiled grammar (cacheable, shared by every
request with the same spec) and makes a fresh matcher per request from it. A matcher accepts
sampled tokens, fills its row of the int32 token bitmask (bit j of word i set: token 32*i+j
allowed), rolls back and says when the grammar is finished.

- GuidanceBackend: llguidance (the default): no torch, builds its tokenizer from the model's
  tokenizer.json, Lark/GBNF grammars, the widest JSON-schema coverage.
- XgrammarBackend: xgrammar (optional extra; importing it imports torch).
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import numpy as np

from jaxinfer.config import StructuredOutputsConfig
from jaxinfer.core.token_masks import bitmask_width
from jaxinfer.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class Grammar:
    """One request's matcher."""

    def accept_tokens(self, tokens: list[int]) -> bool:  # False: a token was rejected
        raise NotImplementedError

    def validate_tokens(self, tokens: list[int]) -> int:  # how many would be accepted
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:  # the grammar is complete: the request ends ("stop")
        raise NotImplementedError


class Backend:
    name = ""

    def validate(self, params: StructuredOutputsParams) -> None:
        """ValueError naming the field and the problem (cheap: no full compile)."""
        raise NotImplementedError

    def compile(self, params: StructuredOutputsParams) -> Any:
        raise NotImplementedError

    def new_grammar(self, compiled: Any) -> Grammar:
        raise NotImplementedError

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: np.ndarray) -> None:
        """Row i of `bitmask` for grammars[i]."""
        for i, g in enumerate(grammars):
            g.fill_bitmask(bitmask, i)


def _field_error(params: StructuredOutputsParams, msg: str) -> ValueError:
    return ValueError(f"structured_outputs.{params.kind}: {msg}")


# -- JSON-schema helpers ---------------------------------------------------------------------
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
               "additionalItems", "unevaluatedItems", "not", "if", "then", "else", "items",
               "prefixItems", "allOf", "anyOf", "oneOf")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that lists properties and says nothing of
    additionalProperties gets additionalProperties: false (disable_additional_properties)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for sub in node[key].values():
                    walk(sub)
        for key in _SUBSCHEMAS:
            if isinstance(node.get(key), (dict, list)):
                walk(node[key])
        if "additionalProperties" not in node and (isinstance(node.get("properties"), dict)
                                                   or isinstance(node.get("patternProperties"),
                                                                 dict)):
            node["additionalProperties"] = False

    walk(schema)
    return schema


def _schema_of(params: StructuredOutputsParams) -> Any:
    if params.json_object:
        return {"type": "object"}
    schema = params.json
    if schema is True:
        return {}
    return schema


def parse_structural_tag(params: StructuredOutputsParams) -> list[dict]:
    """vLLM's structural_tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    try:
        tag = json.loads(params.structural_tag)
        triggers = tag["triggers"]
        structures = tag["structures"]
        out = []
        for s in structures:
            trig = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trig is None:
                raise ValueError(f"begin {s['begin']!r} starts with none of the triggers "
                                 f"{triggers}")
            out.append({"trigger": trig, "begin": s["begin"], "schema": s["schema"],
                        "end": s["end"]})
    except (ValueError, KeyError, TypeError) as e:
        raise _field_error(params, f"not a valid structural tag ({type(e).__name__}: {e}); "
                                   "expected {\"structures\": [{\"begin\", \"schema\", \"end\"}],"
                                   " \"triggers\": [...]}") from None
    if not out:
        raise _field_error(params, "no structures given")
    return out


# -- llguidance -----------------------------------------------------------------------------
class GuidanceGrammar(Grammar):
    def __init__(self, matcher):
        self.matcher = matcher
        self._logged = False

    def _log_error(self) -> None:
        if not self._logged and self.matcher.is_error():
            self._logged = True
            logger.warning("llguidance matcher error: %s", self.matcher.get_error())

    def accept_tokens(self, tokens):
        if self.matcher.is_stopped():
            return True
        ok = self.matcher.consume_tokens(list(tokens))
        self._log_error()
        return ok

    def validate_tokens(self, tokens):
        if self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(list(tokens))

    def rollback(self, num_tokens):
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask, row):
        # A stopped (or failed) matcher yields an EOS-only row.
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    def is_terminated(self):
        return self.matcher.is_stopped()


class GuidanceBackend(Backend):
    name = "guidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None,
                 config: StructuredOutputsConfig):
        import llguidance

        self.llg = llguidance
        self.config = config
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_token_id)
        self.vocab_size = self.tokenizer.vocab_size
        self._executor = None

    def _json_schema(self, schema, params: StructuredOutputsParams):
        """The schema as llguidance compiles it: closed objects if asked, and the whitespace
        options as its "x-guidance" defaults."""
        if params.disable_additional_properties or self.config.disable_additional_properties:
            schema = close_objects(schema)
        options: dict[str, Any] = {"whitespace_flexible": not (
            params.disable_any_whitespace or self.config.disable_any_whitespace)}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}

    def _json_grammar(self, schema, params: StructuredOutputsParams) -> str:
        return self.llg.LLMatcher.grammar_from_json_schema(self._json_schema(schema, params))

    def serialize(self, params: StructuredOutputsParams) -> str:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                return self._json_grammar(_schema_of(params), params)
            if kind == "structural_tag":
                structures = parse_structural_tag(params)
                tags = [self.llg.StructTag(trigger=s["trigger"], begin=s["begin"],
                                           grammar=self._json_schema(s["schema"], params),
                                           end=s["end"])
                        for s in structures]
                # Triggers like <tool_call> are matched as special tokens only when the
                # tokenizer has them as such; otherwise as text.
                special = all(self._is_special(s["trigger"]) for s in structures)
                return self.llg.StructTag.to_grammar(tags, assume_special=special)
            return self.llg.grammar_from(kind, params.spec)
        except (ValueError, TypeError, KeyError, AssertionError) as e:
            raise _field_error(params, f"invalid specification: {e}") from None

    def _is_special(self, text: str) -> bool:
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        return len(ids) == 1 and self.tokenizer.is_special_token(ids[0])

    def validate(self, params):
        err = self.llg.LLMatcher.validate_grammar(self.serialize(params), self.tokenizer)
        if err:
            raise _field_error(params, err.strip())

    def compile(self, params):
        matcher = self.llg.LLMatcher(self.tokenizer, self.serialize(params), log_level=0)
        if matcher.is_error():
            raise _field_error(params, matcher.get_error().strip())
        return matcher

    def new_grammar(self, compiled):
        return GuidanceGrammar(compiled.deep_copy())

    def fill_bitmasks(self, grammars, bitmask):
        if len(grammars) < 8:
            return super().fill_bitmasks(grammars, bitmask)
        if self._executor is None:
            self._executor = self.llg.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(g.matcher, i) for i, g in enumerate(grammars)], bitmask.ctypes.data,
            bitmask.shape[1] * 4, bitmask.shape[0])


# -- xgrammar -------------------------------------------------------------------------------
# JSON-schema keywords xgrammar does not enforce (vLLM refuses them for xgrammar as well).
_XGRAMMAR_UNSUPPORTED = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains",
                         "patternProperties", "propertyNames")


def xgrammar_unsupported(schema: Any) -> str | None:
    if isinstance(schema, dict):
        for key in _XGRAMMAR_UNSUPPORTED:
            if key in schema:
                return key
        children = schema.values()
    elif isinstance(schema, list):
        children = schema
    else:
        return None
    for child in children:
        found = xgrammar_unsupported(child)
        if found:
            return found
    return None


def _is_lark(grammar: str) -> bool:
    return "::=" not in grammar


class XgrammarGrammar(Grammar):
    def __init__(self, matcher):
        self.matcher = matcher

    def accept_tokens(self, tokens):
        for t in tokens:
            if self.matcher.is_terminated():
                return True
            if not self.matcher.accept_token(int(t)):
                return False
        return True

    def validate_tokens(self, tokens):
        n = 0
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def rollback(self, num_tokens):
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask, row):
        if self.matcher.is_terminated():
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self):
        return self.matcher.is_terminated()


class XgrammarBackend(Backend):
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None,
                 config: StructuredOutputsConfig):
        try:
            import xgrammar
        except ImportError:
            raise ValueError("structured_outputs_config.backend='xgrammar' needs the xgrammar "
                             "package: pip install 'jaxinfer[xgrammar]'") from None
        import tokenizers
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        self.config = config
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(
            tokenizer_json))
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                       stop_token_ids=stop)
        self.vocab_size = vocab_size
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def _choice_ebnf(self, choices: list[str]) -> str:
        return "root ::= " + " | ".join(json.dumps(c) for c in choices)

    def validate(self, params):
        xgr, kind = self.xgr, params.kind
        if params.disable_additional_properties:
            raise _field_error(params, "disable_additional_properties is only supported by "
                                       "the guidance backend")
        if params.whitespace_pattern is not None:
            raise _field_error(params, "whitespace_pattern is only supported by the guidance "
                                       "backend")
        try:
            if kind in ("json", "json_object"):
                schema = _schema_of(params)
                bad = xgrammar_unsupported(schema)
                if bad:
                    raise _field_error(params, f"the JSON-schema keyword {bad!r} is not "
                                               "supported by the xgrammar backend")
                xgr.Grammar.from_json_schema(json.dumps(schema))
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(self._choice_ebnf(params.choice))
            elif kind == "grammar":
                if _is_lark(params.grammar):
                    xgr.Grammar.from_lark(params.grammar)
                else:
                    xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "structural_tag":
                parse_structural_tag(params)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError and its own error types
            raise _field_error(params, f"invalid specification: {e}") from None

    def compile(self, params):
        c, kind = self.compiler, params.kind
        any_ws = not (params.disable_any_whitespace or self.config.disable_any_whitespace)
        if kind == "json":
            return c.compile_json_schema(json.dumps(_schema_of(params)), any_whitespace=any_ws)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_grammar(self._choice_ebnf(params.choice))
        if kind == "grammar":
            if _is_lark(params.grammar):
                return c.compile_lark(params.grammar)
            return c.compile_grammar(params.grammar)
        tags = [self.xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"])
                for s in parse_structural_tag(params)]
        triggers = sorted({s["trigger"] for s in parse_structural_tag(params)})
        return c.compile_structural_tag(tags, triggers)

    def new_grammar(self, compiled):
        return XgrammarGrammar(self.xgr.GrammarMatcher(compiled))


def xgrammar_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xgrammar") is not None


BACKENDS = {"guidance": GuidanceBackend, "xgrammar": XgrammarBackend}
