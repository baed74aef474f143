"""dtype="auto" as vLLM resolves it for generating models: the checkpoint's dtype, but a
float32 checkpoint runs in bfloat16. A pooling model's float32 checkpoint stays float32 (vLLM
takes float16 there, for precision; config/model.py engine_dtype says why not here). An
explicit dtype is kept; float16 for a family vLLM refuses it for (Gemma 2 / 3, GLM-4) is
refused by name. The KV cache follows the weights at kv_cache_dtype="auto"."""

from __future__ import annotations

import json
import os

import pytest

from jaxinfer.config import EngineConfig, resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "benchmarks", "configs", "tiny-llama")  # (a float32 config.json)


def _folder(tmp_path, **changes) -> str:
    with open(os.path.join(TINY, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


def _dtypes(model: str, **kw) -> tuple[str, str]:
    rc = resolve_config(EngineConfig(model=model, skip_tokenizer_init=True, **kw))
    return rc.dtype, rc.kv_cache_dtype


def test_auto_runs_a_float32_checkpoint_in_bfloat16_and_keeps_what_is_asked(tmp_path):
    assert EngineConfig().dtype == "auto"
    assert _dtypes(TINY) == ("bfloat16", "bfloat16")
    assert _dtypes(TINY, dtype="float32") == ("float32", "float32")
    assert _dtypes(TINY, dtype="float16") == ("float16", "float16")
    assert _dtypes(TINY, kv_cache_dtype="float32") == ("bfloat16", "float32")
    # a checkpoint declared in half precision keeps its dtype; one declaring none is float32
    assert _dtypes(_folder(tmp_path / "h", torch_dtype="float16")) == ("float16", "float16")
    assert _dtypes(_folder(tmp_path / "b", torch_dtype="bfloat16"))[0] == "bfloat16"
    assert _dtypes(_folder(tmp_path / "n", torch_dtype=None))[0] == "bfloat16"


def test_pooling_models_keep_a_float32_checkpoint_and_gemma_refuses_float16(tmp_path):
    assert _dtypes(TINY, runner="pooling")[0] == "float32"
    assert _dtypes(TINY, runner="pooling", dtype="float16")[0] == "float16"
    assert _dtypes(_folder(tmp_path / "b", torch_dtype="bfloat16"), runner="pooling")[0] == \
        "bfloat16"
    gemma = _folder(tmp_path / "g", architectures=["Gemma3ForCausalLM"],
                    model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=32,
                    sliding_window=64)
    assert _dtypes(gemma)[0] == "bfloat16"
    with pytest.raises(ValueError, match="dtype='float16'.*Gemma3ForCausalLM"):
        _dtypes(gemma, dtype="float16")
