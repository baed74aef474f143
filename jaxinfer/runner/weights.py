"""The weights of a live engine: updates from a trainer or a folder, sleep and wake-up.

An update builds every new parameter first (checked: names, shapes, dtypes, finite values)
and only then swaps them in, all at once, between two steps: a bad tensor changes nothing.
A swap replaces arrays by identity wherever the engine holds them: the step program's state
(what the next step reads), the model's variables and the program's own copy (what later
compilations and updates read), and the LoRA slots' bookkeeping. The compiled steps take the
weights as arguments, so nothing recompiles as long as shapes, dtypes and shardings stay.

Two layouts come in:
- "hf": HF checkpoint tensor names ([out, in] weights, separate q/k/v and gate/up), converted
  exactly as the loader converts a checkpoint (models/loader.convert_tensors: fused, packed,
  quantized where the engine quantizes, KV heads replicated under tensor parallelism). The
  conversion runs on the host, so device arrays are copied out and back.
- "engine": the engine's own parameters by path (`engine_weights()` lists them), in its
  layout; an array that already has the parameter's sharding is taken as it is, with no copy
  (a trainer's jax.Array on the same devices), any other is placed with jax.device_put. The
  engine then holds the caller's arrays: they must not be donated or deleted afterwards.

Sleep (level 1) copies the weights to host memory and deletes the device buffers of the
weights and the KV cache; level 2 deletes the weights without a copy (an update or
reload_weights brings them back). Wake-up places them again with the same shardings; the
compiled programs are kept.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.runner.host_malloc import release_freed_memory
from jaxinfer.runner.huge_pages import back_with_huge_pages_later
from jaxinfer.runner.step_state import abstract

logger = logging.getLogger(__name__)

LAYOUTS = ("hf", "engine")
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_offset")


def _name(path) -> str:
    return ".".join(str(p) for p in path)


def live_device_bytes() -> int:
    """Bytes of every live (not deleted) jax.Array of this process."""
    return int(sum(x.nbytes for x in jax.live_arrays()))


def _is_float(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or "float" in dtype.name  # (bfloat16 / float8: ml_dtypes)


def _weight_of(scale_name: str) -> str:
    """model.x.weight_scale (_scale_inv, _offset) -> model.x.weight"""
    return next(scale_name[: -len(s)] for s in _SCALE_SUFFIXES
                if scale_name.endswith(s)) + ".weight"


def _finite(a: np.ndarray) -> bool:
    """No NaN or infinity (bfloat16: its exponent bits, without a float32 copy)."""
    if a.dtype.kind == "f":
        return bool(np.isfinite(a).all())
    if a.dtype.name == "bfloat16":
        return not bool(((a.view(np.uint16) & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(a.astype(np.float32)).all())


def _leaves(tree) -> list:
    return jax.tree.leaves(tree)


class WeightManager:
    """Updates, sleep and wake-up of one worker's weights (not pipeline-parallel: refused)."""

    def __init__(self, worker):
        self.worker = worker
        self.version = 0  # updates applied so far
        self.asleep: int = 0  # 0 awake, else the sleep level
        self.sleeping_tags: set[str] = set()  # what is still asleep: "weights", "kv_cache"
        self._host: list | None = None  # level 1: host copies of the weight leaves
        self._deleted: list = []  # the deleted weight leaves (ids map them to the new)
        self.last_update: dict = {}
        self._vars: dict | None = None  # path -> the model's Variable (stable objects)
        self.huge_pages_thread = None  # the last swap's collapse (huge_pages.py), if any

    # -- what the engine holds -------------------------------------------------------------------
    @property
    def runner(self):
        return self.worker.runner

    def _variables(self) -> dict:
        """Parameter path -> Variable of the model (LoRA slots left out): the model's own
        Variable objects, so setting one's value updates the model."""
        return {k: v for k, v in self._all_variables().items()
                if not getattr(v, "lora", False)}

    def _all_variables(self) -> dict:
        if self._vars is None:
            flat = nnx.to_flat_state(nnx.state(self.worker.model))
            self._vars = {_name(path): var for path, var in flat}
        return self._vars

    def engine_weights(self) -> dict[str, jax.Array]:
        """The engine's parameters by path, in its own layout (what layout="engine" takes)."""
        self._check_awake("engine_weights")
        return {name: var.get_value() for name, var in self._variables().items()}

    def _check_awake(self, what: str) -> None:
        if "weights" in self.sleeping_tags:
            raise ValueError(f"{what}: the engine's weights are asleep; wake_up first")

    # -- updates ----------------------------------------------------------------------------------
    def update(self, weights: Mapping, layout: str = "hf", only_known: bool = False) -> dict:
        """Swap in new weights (see the module docstring); returns what was done: tensors,
        parameters, bytes placed, seconds, and how many arrays were taken without a copy.
        only_known (a checkpoint folder): tensors no parameter is made of are skipped, not
        refused."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not supported (supported: "
                             f"{', '.join(LAYOUTS)})")
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a mapping of names to arrays, got "
                            f"{type(weights).__name__}")
        if not weights:
            raise ValueError("update_weights: no tensors given")
        self._check_awake("update_weights")
        t0 = time.perf_counter()
        variables = self._variables()
        self._skipped: list[str] = []
        if layout == "engine":
            new, copied = self._engine_layout(weights, variables)
        else:
            new = self._hf_layout(weights, variables, only_known)
            copied = len(new)
        jax.block_until_ready(list(new.values()))  # (placed, before any step reads them)
        self._swap({id(variables[n].get_value()): a for n, a in new.items()})
        self.version += 1
        self.last_update = {
            "layout": layout, "num_tensors": len(weights), "num_parameters": len(new),
            "num_arrays_copied": copied, "num_arrays_taken": len(new) - copied,
            "skipped": list(self._skipped),
            "bytes": int(sum(a.nbytes for a in new.values())),
            "seconds": time.perf_counter() - t0}
        return dict(self.last_update)

    def _engine_layout(self, weights: Mapping, variables: dict) -> tuple[dict, int]:
        unknown = [k for k in weights if k not in variables]
        if unknown:
            raise ValueError(f"update_weights: {unknown[0]!r} is not a parameter of this engine"
                             + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                             + " (layout='engine' takes the names engine_weights() lists)")
        new, copied = {}, 0
        for name, value in weights.items():
            old = variables[name].get_value()
            shape, dtype = tuple(np.shape(value)), np.dtype(getattr(value, "dtype", None)
                                                           or np.asarray(value).dtype)
            if shape != tuple(old.shape) or dtype != np.dtype(old.dtype):
                raise ValueError(f"update_weights: {name!r} is {dtype.name}{list(shape)}, the "
                                 f"engine holds {np.dtype(old.dtype).name}{list(old.shape)}")
            if isinstance(value, jax.Array) and not value.is_deleted() and \
                    value.sharding == old.sharding:
                new[name] = value  # the trainer's buffer itself: no copy
            else:
                new[name] = jax.device_put(value, old.sharding)
                copied += 1
        return new, copied

    def _hf_layout(self, weights: Mapping, variables: dict, only_known: bool) -> dict:
        from jaxinfer.models.loader import (convert_tensors, param_sources, source_owners,
                                            vl_names)

        w = self.worker
        # (a vision-language model's state dict under transformers 5's module paths: the
        # names its checkpoint files would be read under)
        weights = vl_names(dict(weights))
        sources, _, _ = param_sources(variables, weights)
        owners = source_owners(sources)
        names = [k for k in weights if not k.endswith(_SCALE_SUFFIXES)]
        # (a tied model's HF state dict repeats the embedding as lm_head.weight: the
        # embedding is what the engine reads; skipped and reported)
        skipped = [k for k in names if k == "lm_head.weight" and k not in owners
                   and w.model_config.tie_word_embeddings]
        names = [k for k in names if k not in skipped]
        if only_known:
            names = [k for k in names if k in owners]
        # A weight's scale (and GGUF offset) goes with the weight: alone it changes nothing.
        orphans = [k for k in weights if k.endswith(_SCALE_SUFFIXES)
                   and _weight_of(k) not in names]
        if orphans and not only_known:
            raise ValueError(f"update_weights: {orphans[0]!r} comes without its weight "
                             f"{_weight_of(orphans[0])!r}")
        weights = {k: v for k, v in weights.items() if k in names
                   or (k.endswith(_SCALE_SUFFIXES) and k not in orphans)}
        if not names:
            raise ValueError("update_weights: none of the tensors is one this model is made of")
        unknown = [k for k in names if k not in owners]
        if unknown:
            raise ValueError(f"update_weights: no parameter of this model is made from tensor "
                             f"{unknown[0]!r}"
                             + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
        touched = {p for k in names for p in owners[k]}
        for p in sorted(touched):
            missing = [s for s in sources[p] if s not in weights]
            if missing:
                raise ValueError(f"update_weights: {p!r} is made of {len(sources[p])} "
                                 f"checkpoint tensors and {missing[0]!r}"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                    else "")
                                 + " is missing: send all of them together")
        host: dict[str, np.ndarray] = {}
        for k, v in weights.items():
            a = np.asarray(v)
            if not _is_float(a.dtype):
                raise ValueError(f"update_weights: tensor {k!r} is {a.dtype}, not a floating "
                                 "point type")
            if not _finite(a):
                raise ValueError(f"update_weights: tensor {k!r} has non-finite values")
            host[k] = a
        scales: dict[str, dict[str, np.ndarray]] = {}
        for k, a in host.items():
            for suffix, field in ((".weight_scale", "scale"), (".weight_scale_inv", "scale"),
                                  (".weight_offset", "offset")):
                if k.endswith(suffix):
                    scales.setdefault(k[: -len(suffix)] + ".weight", {})[field] = \
                        np.asarray(a, np.float32)
        by_var = {id(var): name for name, var in variables.items()}
        placed: dict[str, np.ndarray] = {}

        def put(var, value, expert_parallel=False):
            placed[by_var[id(var)]] = value

        pending = convert_tensors(
            variables, {p: sources[p] for p in touched},
            ((k, host[k]) for k in names), ckpt_scales=scales, kv_repeat=w.kv_repeat,
            head_dim=w.model_config.head_dim, qcfg=w.model_config.quantization, put=put)
        assert not pending, pending  # (every source was checked present above)
        new = {}
        for name, value in placed.items():
            old = variables[name].get_value()
            value = np.ascontiguousarray(value).reshape(np.shape(value))
            if tuple(value.shape) != tuple(old.shape) or value.dtype != np.dtype(old.dtype):
                raise ValueError(f"update_weights: {name!r} came out {value.dtype}"
                                 f"{list(value.shape)}, the engine holds "
                                 f"{np.dtype(old.dtype).name}{list(old.shape)}")
            new[name] = jax.device_put(value, old.sharding)
        self._skipped = skipped
        return new

    # -- swapping arrays wherever they are held ---------------------------------------------------
    def _swap(self, replace: dict) -> None:
        """Replace arrays (by id) in the step state, the model and the program's copy."""
        runner = self.runner

        def sub(tree):
            return jax.tree.map(lambda x: replace.get(id(x), x), tree)

        state = runner.state
        params = sub(state.params)
        runner.state = dataclasses.replace(state, params=params)
        for var in self._all_variables().values():
            new = replace.get(id(var.get_value()))
            if new is not None:
                var.set_value(new)
        runner.program.set_params(params)
        if runner.lora is not None:
            runner.lora.refresh()
        if getattr(self.worker, "huge_pages", False):  # as at start-up, in the background
            self.huge_pages_thread = back_with_huge_pages_later(list(replace.values()))

    # -- sleep / wake up --------------------------------------------------------------------------
    def sleep(self, level: int) -> dict:
        """Free the device's weights (level 1: copied to the host first; level 2: dropped)
        and KV cache; returns the live bytes before and after."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 here, got {level!r}")
        if self.asleep:
            raise ValueError(f"the engine is already asleep (level {self.asleep})")
        before = live_device_bytes()
        t0 = time.perf_counter()
        runner = self.runner
        state = runner.state
        weights = _leaves((state.params, state.draft_params))
        self._host = [np.array(x, copy=True) for x in weights] if level == 1 else None
        kv = _leaves((state.kv, state.draft_kv))
        runner.state = dataclasses.replace(
            state, params=abstract(state.params), kv=abstract(state.kv),
            draft_params=abstract(state.draft_params), draft_kv=abstract(state.draft_kv))
        for x in weights + kv:
            x.delete()
        if getattr(self.worker, "malloc_keep", False):  # (the heap's freed pages back to the
            release_freed_memory()  # system: host_malloc's thresholds would keep them)
        self._deleted = weights
        self.asleep, self.sleeping_tags = level, {"weights", "kv_cache"}
        after = live_device_bytes()
        return {"level": level, "live_bytes_before": before, "live_bytes_after": after,
                "freed_bytes": before - after, "seconds": time.perf_counter() - t0}

    def wake_up(self, tags=None) -> dict:
        """Place the weights and / or the KV cache again (tags: "weights", "kv_cache";
        None: both). Weights dropped at level 2 come back as zeros: update or reload them."""
        tags = set(self.sleeping_tags if tags is None else tags) & self.sleeping_tags
        before = live_device_bytes()
        t0 = time.perf_counter()
        runner = self.runner
        state = runner.state
        if "kv_cache" in tags:
            kv, draft_kv = jax.tree.map(_zeros, (state.kv, state.draft_kv))
            runner.state = state = dataclasses.replace(state, kv=kv, draft_kv=draft_kv)
        if "weights" in tags:
            shapes, treedef = jax.tree.flatten((state.params, state.draft_params))
            if self._host is not None:
                leaves = [jax.device_put(h, s.sharding) for h, s in zip(self._host, shapes)]
            else:
                leaves = [_zeros(s) for s in shapes]
                logger.warning("wake_up: the weights were dropped (sleep level 2) and are "
                               "zeros now: load them with update_weights, "
                               "update_weights_from_path or reload_weights")
            params, draft_params = jax.tree.unflatten(treedef, leaves)
            runner.state = dataclasses.replace(state, params=params,
                                               draft_params=draft_params)
            self._swap({id(o): n for o, n in zip(self._deleted, leaves)})
            if runner.lora is not None and self._host is None:
                runner.lora.refresh(clear_slots=True)
            self._host, self._deleted = None, []
        self.sleeping_tags -= tags
        if not self.sleeping_tags:
            self.asleep = 0
        return {"tags": sorted(tags), "live_bytes_before": before,
                "live_bytes_after": live_device_bytes(), "seconds": time.perf_counter() - t0}


def _zeros(s):
    if s is None:
        return None
    return jnp.zeros(s.shape, s.dtype, device=s.sharding)
