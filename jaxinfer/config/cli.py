"""EngineConfig's fields as command-line flags, generated from the dataclass (vLLM's
EngineArgs.add_cli_args): `add_engine_args` gives `jaxinfer generate`, `serve` and every
`bench` command the same flags, `engine_config_from_args` reads them back, `engine_flags`
writes a config's options as flags again (a benchmark starting `jaxinfer serve`). A field's
flag is its name with dashes (booleans also as --no-NAME); FLAGS adds vLLM's short aliases,
choices and help."""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxinfer.config.engine import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, SCHEDULING_POLICIES,
                                    STEP_COMPILATIONS, WARMUP_BUCKETS, EngineConfig)
from jaxinfer.config.features import (RUNNERS, KVTransferConfig, PoolerConfig,
                                      SpeculativeConfig, StructuredOutputsConfig)
from jaxinfer.config.quant import QUANTIZATION_METHODS
from jaxinfer.reasoning import REASONING_PARSERS

_SUB_CONFIGS = {"structured_outputs_config": StructuredOutputsConfig,
                "speculative_config": SpeculativeConfig, "kv_transfer_config": KVTransferConfig,
                "pooler_config": PoolerConfig}


def json_object(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


# Per field: the value type where the default (None) does not say it, vLLM's aliases,
# choices and help. Every EngineConfig field gets a flag whether or not it is listed here.
FLAGS: dict[str, dict] = {
    "model": dict(type=str, help="HF model folder or .gguf file (default: embedded SmolLM2)"),
    "tokenizer": dict(type=str, help="tokenizer folder (default: the model's)"),
    "skip_tokenizer_init": dict(help="load no tokenizer: token-id prompts in, token ids out"),
    "dtype": dict(help="weight dtype: auto (the checkpoint's, but a generating model's "
                  "float32 one runs in bfloat16, as in vLLM), float32, bfloat16, float16"),
    "max_model_len": dict(type=int, help="longest sequence, prompt + output (default: the "
                                         "model's max_position_embeddings)"),
    "max_num_batched_tokens": dict(type=int, help="token budget of one step (default: "
                                                  "max(2048, max_num_seqs))"),
    "block_size": dict(type=int, help="tokens per KV block (default: 128 on CPU, as vLLM's "
                                      "CPU backend; 16 on GPUs)"),
    "kv_cache_dtype": dict(choices=KV_CACHE_DTYPES, help="auto: the model's dtype; fp8 (= "
                           "fp8_e4m3) / fp8_e5m2: a quarter of float32's bytes per token"),
    "quantization": dict(type=str, aliases=("-q",), choices=QUANTIZATION_METHODS,
                         help="fp8 / int8: quantize the linear weights at load (per output "
                              "channel); gguf: a .gguf model keeps its quantized blocks; "
                              "default: the checkpoint's quantization_config"),
    "enable_prefix_caching": dict(help="automatic prefix caching (--no-enable-prefix-caching "
                                       "turns it off)"),
    "scheduling_policy": dict(choices=SCHEDULING_POLICIES,
                              help="priority: requests with a lower `priority` run first"),
    "load_format": dict(choices=("auto", "safetensors", "dummy"),
                        help="dummy: random weights of the right shapes, made on the device"),
    "attention_backend": dict(type=str, choices=ATTENTION_BACKENDS,
                              help="auto: the C++ kernels on CPU, xla elsewhere"),
    "tensor_parallel_size": dict(aliases=("-tp",)),
    "enable_expert_parallel": dict(help="mixture-of-experts models: experts split over the "
                                        "tensor-parallel devices (E / tp whole experts each)"),
    "enable_sequence_parallelism": dict(help="tensor parallelism: the residual stream split "
                                             "by tokens between the tensor-parallel regions"),
    "num_kv_blocks": dict(type=int, aliases=("--num-gpu-blocks-override",),
                          help="KV cache size in blocks (default: from the memory budget; "
                               "a model with sliding and full layers: the full layers' pool)"),
    "kv_cache_memory_bytes": dict(type=int, help="KV cache budget in bytes"),
    "disable_hybrid_kv_cache_manager": dict(
        help="one KV pool for every layer; by default a model with sliding and full layers "
             "keeps its sliding layers' KV in a pool that frees out-of-window blocks"),
    "compilation_cache_dir": dict(type=str, help="persistent compile cache (default: "
                                                 "<cache>/xla; '' turns it off)"),
    "warmup": dict(help="compile the start-up buckets before serving (--no-warmup: compile "
                        "buckets lazily)"),
    "warmup_buckets": dict(choices=WARMUP_BUCKETS, help="start: the decode buckets before "
                           "serving, the rest on first use or in the background; all: every "
                           "bucket before serving (layer-wise: the decode buckets fused "
                           "too)"),
    "step_compilation": dict(choices=STEP_COMPILATIONS, help="whole: a step is one program, "
                             "every layer unrolled; layerwise: runs of layers compiled once "
                             "(compile time independent of depth); auto: layerwise on CPU, "
                             "whole on GPU"),
    "layers_per_program": dict(help="layerwise: decoder layers per compiled program"),
    "enable_multiprocessing": dict(type=bool, help="the engine core in its own process "
                                   "(default: JAXINFER_ENABLE_MULTIPROCESSING, else on)"),
    "async_scheduling": dict(type=bool, help="dispatch step N+1 before reading step N's "
                             "tokens (host/device overlap; default: on, off with speculative "
                             "decoding, pipeline parallelism or a pooling runner)"),
    "structured_outputs_config": dict(help='structured outputs, as JSON: {"backend": "auto" '
                                      '| "guidance" | "xgrammar", "disable_any_whitespace": '
                                      'bool, "disable_additional_properties": bool, '
                                      '"compile_timeout_s": float}'),
    "speculative_config": dict(help='speculative decoding, as JSON (vLLM\'s names): '
                               '{"method": "ngram" | "draft_model" | "eagle" | "eagle3" | '
                               '"mtp", '
                               '"num_speculative_tokens": K, "model": DIR, ...}'),
    "kv_transfer_config": dict(help='a KV connector, as JSON (vLLM\'s names): {"kv_connector":'
                               ' "JaxTransferConnector" | "SharedStorageConnector", "kv_role": '
                               '"kv_producer" | "kv_consumer" | "kv_both", ...}'),
    "data_parallel_size": dict(aliases=("-dp",), help="engine-core processes (data-parallel "
                               "ranks), each with tensor_parallel_size devices of its own"),
    "data_parallel_prefix_affinity": dict(help="prompts sharing their first blocks go to the "
                                          "rank that has them cached, unless it is much busier"),
    "pipeline_parallel_size": dict(aliases=("-pp",), help="decoder layers split over this "
                                   "many stages, each on its own devices"),
    "pp_layer_partition": dict(type=str, help="layers per stage, e.g. 4,4,5,3 (or "
                                              "JAXINFER_PP_LAYER_PARTITION)"),
    "logits_processors": dict(type=str, nargs="+", help="custom logits processors, as import "
                              "paths (module:Class or module.Class) of LogitsProcessor "
                              "subclasses"),
    "reasoning_parser": dict(type=str, choices=tuple(REASONING_PARSERS),
                             help="split a reasoning model's thinking into reasoning_content "
                                  "(chat route); structured outputs apply after it"),
    "limit_mm_per_prompt": dict(type=str, help='images a prompt may carry at most, as JSON: '
                                '\'{"image": 2}\' (vision-language models; default 999)'),
    "enable_lora": dict(help="serve LoRA adapters (PEFT folders) over the base model, mixed "
                             "in one batch (serve: --lora-modules, /v1/load_lora_adapter)"),
    "max_loras": dict(help="distinct LoRA adapters in one step (device slots)"),
    "max_lora_rank": dict(help="the LoRA slots' rank: adapters of a higher rank are refused"),
    "max_cpu_loras": dict(type=int, help="LoRA adapters kept loaded on the host (default: "
                                         "max_loras)"),
    "enable_sleep_mode": dict(help="allow sleep levels 1 and 2: free the device's weights "
                                   "and KV cache between rollouts (RL; serve: /sleep, "
                                   "/wake_up with VLLM_SERVER_DEV_MODE=1)"),
    "runner": dict(choices=RUNNERS, help="generate (text), pooling (embeddings: "
                   "/v1/embeddings, /v1/score, /rerank), auto: pooling for a bare decoder "
                   "checkpoint (e.g. Qwen3Model), else generate"),
    "task": dict(type=str, choices=("embed", "generate"), help="vLLM's older spelling: embed = "
                 "--runner pooling"),
    "pooler_config": dict(help='how a pooling engine pools, as JSON (vLLM\'s names): '
                          '{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool, '
                          '"dimensions": N} (default: the folder\'s sentence-transformers '
                          'config, else LAST, normalized)'),
    "generation_config": dict(help="auto: the model's generation_config.json sets the default "
                              "sampling parameters (a request's own values override them); "
                              "vllm: the built-in defaults; or a folder with a "
                              "generation_config.json"),
}


def _fields():
    return [f for f in dataclasses.fields(EngineConfig) if f.init]


def add_engine_args(parser, *, defaults: dict | None = None, skip=()) -> None:
    """One flag per EngineConfig field (but `skip`), with EngineConfig's defaults unless
    `defaults` gives the command's own."""
    defaults = defaults or {}
    for f in _fields():
        if f.name in skip:
            continue
        spec = FLAGS.get(f.name, {})
        names = [f"--{f.name.replace('_', '-')}", *spec.get("aliases", ())]
        kw = dict(dest=f.name, default=defaults.get(f.name, f.default), help=spec.get("help"))
        kind = spec.get("type") or type(f.default)
        if f.name in _SUB_CONFIGS:
            kw["type"] = json_object
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if "choices" in spec:
                kw["choices"] = list(spec["choices"])
            if "nargs" in spec:
                kw["nargs"] = spec["nargs"]
        parser.add_argument(*names, **kw)


def engine_kwargs(args, **overrides) -> dict:
    """The EngineConfig keyword arguments the flags of `args` give, as parsed (JSON-able):
    fields the command has no flag for are left out, and so is None where the field has a
    default of its own."""
    kwargs = {}
    for f in _fields():
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            if value is None and f.default is not None:
                continue
            kwargs[f.name] = value
    kwargs.update(overrides)
    return kwargs


def engine_config_from_args(args, **overrides) -> EngineConfig:
    """The EngineConfig the flags of `args` describe (see engine_kwargs)."""
    return EngineConfig(**engine_kwargs(args, **overrides))


def engine_flags(args, skip=("model",)) -> list[str]:
    """The engine options of `args` that differ from EngineConfig's defaults, as the flags
    that set them (for another command, e.g. `jaxinfer serve`)."""
    flags = []
    for f in _fields():
        if f.name in skip or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value == f.default:
            continue
        name = f"--{f.name.replace('_', '-')}"
        if isinstance(value, bool):
            flags.append(name if value else f"--no-{f.name.replace('_', '-')}")
        elif isinstance(value, dict):
            flags += [name, json.dumps(value)]
        elif value is not None:
            flags += [name, str(value)]
    return flags
