"""QuantConfig: how a model's linear weights are quantized, from the engine's `quantization`
option and the checkpoint's HF `quantization_config` (pure data; the math is in
jaxinfer/layers/quantization.py, which says what the formats are)."""

from __future__ import annotations

import re
from dataclasses import dataclass

WEIGHT_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8"}
QUANTIZATION_METHODS = ("fp8", "int8", "compressed-tensors", "gguf")
# Largest magnitudes: symmetric int8 uses +-127 (as vLLM and compressed-tensors do).
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
# Decoder linear layers that are quantized (the fused projections and their sources).
QUANTIZED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_REFUSED_HINT = ("supported: fp8 (block-wise or per-tensor), compressed-tensors 8-bit float / "
                 "int weights, or quantization='fp8' / 'int8' at load")


@dataclass(frozen=True)
class QuantConfig:
    """How the decoder's linear weights are held (pure data: part of ModelConfig)."""

    method: str  # "fp8" | "int8" | "compressed-tensors" (what the user or checkpoint named)
    weight_dtype: str  # "float8_e4m3fn" | "int8"
    from_checkpoint: bool  # the checkpoint holds quantized tensors (else: quantize at load)
    # checkpoint block [rows of out, rows of in] (block-wise), else None
    block: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()  # checkpoint module names left unquantized ("lm_head", ...)
    activation_fp8: bool = False  # W8A8: activations to fp8 per token (fp8 weights, GPUs)
    offset: bool = False  # GGUF blocks: w = q * scale + offset (weight_offset beside the scale)

    @property
    def in_block(self) -> int | None:
        return None if self.block is None else self.block[1]

    @staticmethod
    def from_configs(quantization: str | None, hf_config: dict | None) -> "QuantConfig | None":
        """The engine's `quantization` option and the checkpoint's `quantization_config`
        (either may be None) -> the config to build, or None (float weights). Errors name the
        field."""
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={quantization!r} is not supported (supported: "
                             f"{', '.join(QUANTIZATION_METHODS)})")
        if hf_config is None:
            if quantization in ("compressed-tensors", "gguf"):
                raise ValueError(f"quantization={quantization!r} needs a checkpoint quantized "
                                 "that way" + (" (a .gguf file, or model=None: the embedded "
                                               "GGUF)" if quantization == "gguf" else ""))
            if quantization is None:
                return None
            return QuantConfig(method=quantization, weight_dtype=WEIGHT_DTYPES[quantization],
                               from_checkpoint=False)
        method = hf_config.get("quant_method")
        if method == "fp8":
            q = _hf_fp8(hf_config)
        elif method == "compressed-tensors":
            q = _compressed_tensors(hf_config)
        elif method == "gguf":  # (written by jaxinfer's GGUF conversion, checkpoints/gguf_convert.py)
            group = int(hf_config.get("group_size", 32))
            q = QuantConfig(method="gguf", weight_dtype="int8", from_checkpoint=True,
                            block=(1, group), offset=True,
                            ignored=tuple(hf_config.get("modules_to_not_convert") or ()))
        else:
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported "
                             f"({_REFUSED_HINT})")
        if quantization is not None and quantization != method:
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint's "
                             f"quantization_config.quant_method={method!r}")
        return q

    def for_module(self, module: str, sources: tuple[str, ...] = ()) -> "QuantConfig | None":
        """This config if our linear module `module` (e.g. model.layers.0.self_attn.qkv_proj)
        is held quantized, else None: decoder projections are, unless the checkpoint's ignore
        list names them (a fused module, made of the checkpoint's modules `sources` beside it,
        e.g. q_proj, k_proj, v_proj: all of them, or none)."""
        head, _, leaf = module.rpartition(".")
        if leaf == "experts":  # routed experts, stacked: all quantized unless ignored
            probe = [module] + [f"{module}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj",
                                                            "w1", "w2", "w3")]
            skip = self.offset or any(_ignored(m, pat) for m in probe for pat in self.ignored)
            return None if skip else self
        if module == "lm_head" and self.method == "gguf":  # (llama.cpp's output is quantized)
            return None if any(_ignored(module, p) for p in self.ignored) else self
        if leaf not in QUANTIZED_MODULES or ".experts." in module + ".":
            return None
        sources = [f"{head}.{src}" for src in (sources or (leaf,))]
        ignored = [any(_ignored(src, pat) for pat in self.ignored) for src in sources]
        if all(ignored):
            return None
        if any(ignored):
            raise ValueError(f"the checkpoint's quantization_config leaves some of {sources} "
                             "unquantized and quantizes the others: a fused projection "
                             "needs all or none")
        return self


def _ignored(module: str, pattern: str) -> bool:
    """compressed-tensors / HF ignore entries: a module name, a name suffix, or "re:<regex>"."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def _hf_fp8(d: dict) -> QuantConfig:
    fmt = d.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported (supported: e4m3)")
    scheme = d.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported")
    block = d.get("weight_block_size")
    if block is not None:
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"quantization_config.weight_block_size={block!r}: need [n, k]")
        block = (int(block[0]), int(block[1]))
    ignored = tuple(d.get("modules_to_not_convert") or d.get("ignored_layers") or ())
    return QuantConfig(method="fp8", weight_dtype="float8_e4m3fn", from_checkpoint=True,
                       block=block, ignored=ignored)


def _compressed_tensors(d: dict) -> QuantConfig:
    fmt = d.get("format")
    if fmt not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format={fmt!r} (compressed-tensors) is not "
                         f"supported ({_REFUSED_HINT})")
    groups = d.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: {len(groups)} groups; one group "
                         "for all Linear layers is supported")
    group = next(iter(groups.values()))
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"quantization_config.config_groups targets={targets!r} is not "
                         "supported (supported: ['Linear'])")
    w = group.get("weights") or {}
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if bits != 8 or kind not in ("float", "int"):
        raise ValueError(f"quantization_config weights num_bits={bits} type={kind!r} is not "
                         f"supported ({_REFUSED_HINT})")
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise ValueError("quantization_config weights: only symmetric, static weight scales "
                         "are supported")
    if strategy not in ("channel", "tensor", "block"):
        raise ValueError(f"quantization_config weights strategy={strategy!r} is not supported "
                         "(supported: channel, tensor, block)")
    block = None
    if strategy == "block":
        bs = w.get("block_structure") or [128, 128]
        block = (int(bs[0]), int(bs[1]))
    return QuantConfig(method="compressed-tensors",
                       weight_dtype="float8_e4m3fn" if kind == "float" else "int8",
                       from_checkpoint=True, block=block, ignored=tuple(d.get("ignore") or ()))
