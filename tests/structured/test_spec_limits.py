"""Bounded grammar work: specs over the size / depth limits are refused before a backend sees
them, and what the limits allow compiles on the big-stack threads (backends recurse natively:
a deep enough spec on an 8 MiB stack kills the process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxinfer.config import StructuredOutputsConfig
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.structured_output.limits import (StackThreadPool, check_spec_limits,
                                               schema_depth)

LIMITS = dict(max_spec_bytes=StructuredOutputsConfig().max_spec_bytes,
              max_schema_depth=StructuredOutputsConfig().max_schema_depth)


def ref_chain(n: int) -> dict:
    """n definitions, each an object whose one property refers to the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["next"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _names():
    import itertools
    import string

    letters = string.ascii_lowercase  # (Lark: lowercase names are rules)
    for size in itertools.count(1):
        for t in itertools.product(letters, repeat=size):
            yield "".join(t)


def chain_grammar(max_bytes: int) -> tuple[str, int]:
    """The longest chain of Lark rules (r0: r1, r1: r2, ...) in max_bytes, shortest names."""
    names = _names()
    first = next(names)
    lines, size, prev = [f"start: {first}"], len(f"start: {first}") + 1, first
    while True:
        nxt = next(names)
        line = f"{prev}: {nxt}"
        if size + len(line) + 1 + len(f'{nxt}: "x"') > max_bytes:
            break
        lines.append(line)
        size += len(line) + 1
        prev = nxt
    lines.append(f'{prev}: "x"')
    return "\n".join(lines), len(lines) - 2


def test_schema_depth_follows_refs_and_counts_recursion_once():
    assert schema_depth({"type": "string"}, 100) == 1
    assert schema_depth({"properties": {"a": {"type": "string"}}}, 100) == 3
    # each link: the definition, its properties, the property (whose $ref leads on)
    assert schema_depth(ref_chain(10), 1000) == 3 * 10 + 3
    recursive = {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    assert schema_depth(recursive, 1000) < 10
    assert schema_depth(ref_chain(10**5), 300) > 300  # stops early (no recursion in here)


def test_specs_over_the_limits_are_refused_by_name():
    check_spec_limits(StructuredOutputsParams(json=ref_chain(80)), **LIMITS)
    with pytest.raises(ValueError, match="nests more than 256 levels"):
        check_spec_limits(StructuredOutputsParams(json=ref_chain(90)), **LIMITS)
    tag = {"structures": [{"begin": "<f>", "schema": ref_chain(90), "end": "</f>"}],
           "triggers": ["<f>"]}
    with pytest.raises(ValueError, match="max_schema_depth"):
        check_spec_limits(StructuredOutputsParams(structural_tag=json.dumps(tag)), **LIMITS)
    grammar, _ = chain_grammar(LIMITS["max_spec_bytes"])
    check_spec_limits(StructuredOutputsParams(grammar=grammar), **LIMITS)
    for params in (StructuredOutputsParams(grammar=grammar + "\n// " + "x" * 10),
                   StructuredOutputsParams(regex="a" * (LIMITS["max_spec_bytes"] + 1)),
                   StructuredOutputsParams(choice=["x" * 1000] * 200)):
        with pytest.raises(ValueError, match="max_spec_bytes"):
            check_spec_limits(params, **LIMITS)


def test_the_largest_allowed_specs_compile(smollm2_dir):
    """The longest rule chain that fits max_spec_bytes, and the deepest $ref chain that fits
    max_schema_depth, through the front end's validator and the core's compile pool."""
    from jaxinfer.structured_output import StructuredOutputManager, StructuredOutputValidator
    from jaxinfer.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    source = lambda: (tok.backend_json(), tok.eos_token_id)  # noqa: E731
    config = StructuredOutputsConfig(backend="guidance")
    validator = StructuredOutputValidator(config, source, tok.vocab_size)
    manager = StructuredOutputManager(config, source, tok.vocab_size)
    grammar, num_rules = chain_grammar(config.max_spec_bytes)
    assert num_rules > 12000
    for params in (StructuredOutputsParams(grammar=grammar),
                   StructuredOutputsParams(json=ref_chain(80))):
        assert validator.validate(params) == "guidance"
        matcher = manager._executor.submit(manager._compile, "guidance", params).result()
        assert not matcher.is_error()
    manager.shutdown()


_DEEP = textwrap.dedent("""
    import sys
    from jaxinfer.config import StructuredOutputsConfig
    from jaxinfer.sampling_params import StructuredOutputsParams
    from jaxinfer.structured_output import StructuredOutputValidator
    from jaxinfer.tokenizer import Tokenizer
    from tests.structured.test_spec_limits import ref_chain

    tok = Tokenizer(sys.argv[1])
    config = StructuredOutputsConfig(backend="guidance", max_schema_depth=10**6)
    v = StructuredOutputValidator(config, lambda: (tok.backend_json(), tok.eos_token_id),
                                  tok.vocab_size)
    print(v.validate(StructuredOutputsParams(json=ref_chain(int(sys.argv[2])))), flush=True)
""")


def test_a_chain_that_kills_an_8mib_stack_compiles_on_the_big_one(smollm2_dir):
    """A 1000-link $ref chain overflowed llguidance's 8 MiB thread stack (a segfault, found by
    the issue's fuzzing); with the depth limit lifted it compiles on the validator's thread.
    In a child process: were the big stack gone, only the child would die."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _DEEP, smollm2_dir, "1000"], cwd=root,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0 and proc.stdout.strip() == "guidance", proc.stderr[-2000:]


def test_stack_thread_pool_results_errors_and_cancels():
    import threading

    pool = StackThreadPool(1, "t", stack_bytes=64 << 20)
    assert pool.submit(lambda a, b: a + b, 2, 3).result(timeout=30) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=30)
    gate = threading.Event()
    busy = pool.submit(gate.wait)
    while not busy.running():
        threading.Event().wait(0.01)
    queued = pool.submit(lambda: "never")
    pool.shutdown(cancel_futures=True)
    gate.set()
    assert busy.result(timeout=30) is True and queued.cancelled()
    assert threading.stack_size() == 0  # (only the pool's threads got the big stack)
