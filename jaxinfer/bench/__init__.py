"""`jaxinfer bench latency | throughput | serve | roofline` (vLLM-style benchmark output)."""

from __future__ import annotations

import json


def write_result(path: str | None, result: dict) -> dict:
    """Save a benchmark result as JSON (when a path is given) and return it."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result
