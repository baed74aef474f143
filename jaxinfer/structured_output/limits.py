"""Bounded grammar work: size and depth limits checked before a backend sees a spec, and the
threads with big stacks that backends run on.

llguidance (Rust) and xgrammar (C++) recurse natively while they build a grammar: a JSON schema
whose $refs chain a thousand definitions, or a Lark grammar of 3000 chained rules, overflows an
8 MiB thread stack and kills the whole process (no Python exception is raised). So:
- `check_spec_limits` refuses a spec over `max_spec_bytes` or a JSON schema nesting deeper than
  `max_schema_depth` levels (counting the levels its local $refs lead to; cycles count once),
  with a ValueError naming the limit, before any backend sees it (iterative: no recursion here);
- every validation and compile runs on a `StackThreadPool` thread of STACK_BYTES (256 MiB of
  address space, touched only as deep as the recursion goes). Seen with llguidance 1.9: an
  8 MiB stack compiles a 600-link $ref chain and a 2000-rule chain and crashes on 1000 links
  and 3000 rules; 256 MiB compiles 4000 links and 20000 rules. What the default limits allow
  at most (a chain of ~14,000 Lark rules in 128 KiB; 80 $ref links in 256 levels) compiles
  (tests/structured/test_spec_limits.py);
- callers wait with a timeout (`compile_timeout_s`), so a slow spec fails its request.
"""

from __future__ import annotations

import json
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

STACK_BYTES = 256 << 20

_STACK_SIZE_LOCK = threading.Lock()


class StackThreadPool:
    """A few daemon threads with `stack_bytes` stacks running submitted calls."""

    def __init__(self, num_threads: int, name: str, stack_bytes: int = STACK_BYTES):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = []
        with _STACK_SIZE_LOCK:  # (threading.stack_size applies to threads started meanwhile)
            old = threading.stack_size(stack_bytes)
            try:
                for i in range(num_threads):
                    t = threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            finally:
                threading.stack_size(old)

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        if cancel_futures:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._q.put(None)
        if wait:
            for t in self._threads:
                t.join()


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer ("#/$defs/a") inside `root`, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(node: Any, root: Any) -> list:
    if isinstance(node, dict):
        out = [v for v in node.values() if isinstance(v, (dict, list))]
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(root, ref)
            if isinstance(target, (dict, list)):
                out.append(target)
        return out
    if isinstance(node, list):
        return [v for v in node if isinstance(v, (dict, list))]
    return []


def schema_depth(root: Any, limit: int) -> int:
    """The deepest chain of nested containers in a JSON schema, following its local $refs
    (a ref back onto the current path, i.e. recursion, counts once). Stops early once past
    `limit` (then returns a value > limit). Iterative: safe on any input."""
    if not isinstance(root, (dict, list)):
        return 0
    memo: dict[int, int] = {}
    on_path: set[int] = set()
    keep = []  # (ids stay valid: the objects are alive while we look at them)
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            depth = 1 + max((memo.get(id(c), 0) for c in _children(node, root)), default=0)
            memo[key] = depth
            if depth > limit:
                return depth
            continue
        if key in memo or key in on_path:
            continue
        on_path.add(key)
        keep.append(node)
        stack.append((node, True))
        for child in _children(node, root):
            if id(child) not in memo and id(child) not in on_path:
                stack.append((child, False))
    return memo[id(root)]


def check_spec_limits(params, *, max_spec_bytes: int, max_schema_depth: int) -> None:
    """ValueError naming the limit when `params` (StructuredOutputsParams) is too big or its
    JSON schema(s) nest too deeply for the backends to compile safely."""
    kind = params.kind
    spec = params.spec
    schemas = []
    if kind == "json":
        schemas.append(spec)
    elif kind == "structural_tag":
        try:
            tag = json.loads(spec)
        except (ValueError, RecursionError):
            tag = None
        if isinstance(tag, dict) and isinstance(tag.get("structures"), list):
            schemas += [s.get("schema") for s in tag["structures"] if isinstance(s, dict)]
    for schema in schemas:
        depth = schema_depth(schema, max_schema_depth)
        if depth > max_schema_depth:
            raise ValueError(f"structured_outputs.{kind}: the JSON schema nests more than "
                             f"{max_schema_depth} levels deep (counting the definitions its "
                             f"$refs lead to); the limit is "
                             "structured_outputs_config.max_schema_depth")
    if kind in ("json", "choice"):
        try:
            size = len(json.dumps(spec, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        except (ValueError, TypeError, RecursionError) as e:
            raise ValueError(f"structured_outputs.{kind}: cannot be serialised ({e})") from None
    elif isinstance(spec, str):
        size = len(spec.encode("utf-8", "surrogatepass"))
    else:
        size = 0
    if params.whitespace_pattern is not None:
        size += len(params.whitespace_pattern)
    if size > max_spec_bytes:
        raise ValueError(f"structured_outputs.{kind}: the specification is {size} bytes, more "
                         f"than the limit of {max_spec_bytes} bytes "
                         "(structured_outputs_config.max_spec_bytes)")
