"""The folder jaxinfer caches into (converted models, the compile cache, the C++ kernels):
$JAXINFER_CACHE_DIR, else `.cache/` of the source checkout (git-ignored), else
~/.cache/jaxinfer."""

from __future__ import annotations

import os


def cache_dir() -> str:
    env = os.environ.get("JAXINFER_CACHE_DIR")
    if env:
        return env
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(repo, "pyproject.toml")):
        return os.path.join(repo, ".cache")
    return os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer")
