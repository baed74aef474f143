"""jaxinfer's module graph: every import of a jaxinfer module (module level and inside
functions), its cycles, the modules over a line budget, and which modules import jax at
module level.

    .venv/bin/python scripts/import_graph.py [--max-lines 600]     # exit code 1 on a cycle
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules() -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(os.path.join(ROOT, "jaxinfer")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def edges(mods: dict[str, str]) -> tuple[dict[str, set[str]], dict[str, bool]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    jax_at_top: dict[str, bool] = {}
    for mod, path in mods.items():
        tree = ast.parse(open(path).read())
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        top = set(id(n) for n in tree.body)
        jax_at_top[mod] = False
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base
                                                                            else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                if id(node) in top and (name == "jax" or name.startswith("jax.")):
                    jax_at_top[mod] = True
                target = _resolve(name, mods) if name.startswith("jaxinfer") else None
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph, jax_at_top


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-lines", type=int, default=600)
    args = ap.parse_args()
    mods = modules()
    graph, jax_top = edges(mods)
    found = cycles(graph)
    print(f"{len(mods)} modules, {sum(len(v) for v in graph.values())} imports between them")
    for comp in found:
        print("cycle:", " <-> ".join(comp))
    print(f"{len(found)} import cycle(s)")
    for mod, path in sorted(mods.items()):
        n = sum(1 for _ in open(path))
        if n > args.max_lines:
            print(f"over {args.max_lines} lines: {mod} ({n})")
    for mod in ("jaxinfer.engine.core", "jaxinfer.core.scheduler", "jaxinfer.core"):
        if mod in jax_top:
            print(f"{mod} imports jax at module level: {jax_top[mod]}")
    bad_core = [m for m in mods if m.startswith("jaxinfer.core") and jax_top[m]]
    print("core/ modules importing jax at module level:", bad_core or "none")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
