"""`import jaxinfer` (and the core) must stay light: no torch, fastapi or gguf; core has no jax."""

import subprocess
import sys


def _modules_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m.split(".")[0] for m in out.stdout.split()}


def test_import_jaxinfer_is_light():
    mods = _modules_after("import jaxinfer")
    assert not {"torch", "fastapi", "gguf"} & mods
