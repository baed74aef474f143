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


def test_structured_output_validation_is_light(smollm2_dir):
    """The front end's grammar check (llguidance) pulls in neither torch nor jax."""
    mods = _modules_after(
        "from jaxinfer.structured_output import StructuredOutputValidator; "
        "from jaxinfer.config import StructuredOutputsConfig; "
        "from jaxinfer.sampling_params import StructuredOutputsParams as SO; "
        "from jaxinfer.tokenizer import Tokenizer; "
        f"tok = Tokenizer({smollm2_dir!r}); "
        "v = StructuredOutputValidator(StructuredOutputsConfig(), "
        "lambda: (tok.backend_json(), tok.eos_token_id), 49152); "
        "assert v.validate(SO(json={'type': 'object'})) == 'guidance'")
    assert not {"torch", "jax", "transformers"} & mods
