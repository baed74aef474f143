"""The worker's side of multi-LoRA serving: which adapters the engine knows, a host cache of
up to max_cpu_loras loaded ones (least recently used out first; one evicted is read again
from its folder when a request needs it), and the max_loras device slots every targeted
projection holds (layers/lora.py).

Before each step the runner asks for the step's adapters (`activate`): the ones not in a slot
are written into free slots or those used longest ago by no request of this step. A slot is
written by replacing the LoRA arrays wherever the step program's state holds them (one
jitted update of every LoRA array, compiled once; the step programs take them as arguments,
so nothing recompiles). The scheduler admits at most max_loras distinct adapters per step,
so the step's adapters always fit."""

from __future__ import annotations

from collections import OrderedDict

import jax
import numpy as np

from jaxinfer.lora.adapter import Adapter, find_targets, load_adapter
from jaxinfer.lora.request import LoRARequest

class LoRAManager:
    def __init__(self, model, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 head_dim: int):
        self.targets = find_targets(model)
        if not self.targets:
            raise ValueError("enable_lora: the model has no projection LoRA can target")
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu_loras, self.head_dim = max_cpu_loras, head_dim
        first = next(iter(self.targets.values())).module
        self.dtype = np.dtype(first.lora_a.get_value().dtype)
        # The live LoRA arrays, in a fixed order: (path, "a" | "b") -> array, and where each
        # holds its slots.
        self.arrays = {(p, ab): getattr(t.module, f"lora_{ab}").get_value()
                       for p, t in self.targets.items() for ab in ("a", "b")}
        self.slot_axes = tuple(getattr(t.module, f"lora_{ab}").slot_axis
                               for t in self.targets.values() for ab in ("a", "b"))
        self.known: dict[int, LoRARequest] = {}  # every adapter added (by lora_int_id)
        self.cpu: OrderedDict[int, Adapter] = OrderedDict()  # loaded, most recent last
        self.slot_of: dict[int, int] = {}  # resident adapters' slots
        self.slot_ids: list[int | None] = [None] * max_loras
        self.slot_last_use = [0] * max_loras
        self._tick = 0
        self._write = None  # the jitted slot update (built on first use)
        self.num_slot_writes = 0

    # -- the adapters the engine knows -----------------------------------------------------------
    def add(self, req: LoRARequest) -> bool:
        """Know and load `req` (ValueError naming the adapter when it cannot be served).
        False: already known under that id."""
        old = self.known.get(req.lora_int_id)
        if old is not None:
            if old.lora_name != req.lora_name or old.lora_path != req.lora_path:
                raise ValueError(f"lora_int_id {req.lora_int_id} is already adapter "
                                 f"{old.lora_name!r} ({old.lora_path}); give {req.lora_name!r} "
                                 "an id of its own")
            return False
        for other in self.known.values():
            if other.lora_name == req.lora_name:
                raise ValueError(f"a LoRA adapter named {req.lora_name!r} is already loaded "
                                 f"(lora_int_id {other.lora_int_id})")
        self._load(req)
        self.known[req.lora_int_id] = req
        return True

    def remove(self, lora_int_id: int) -> bool:
        if self.known.pop(lora_int_id, None) is None:
            return False
        self.cpu.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = None
        return True

    def list(self) -> list[int]:
        return sorted(self.known)

    def _load(self, req: LoRARequest) -> Adapter:
        adapter = load_adapter(req.lora_name, req.lora_int_id, req.lora_path, self.targets,
                               self.max_rank, self.head_dim, self.dtype)
        self.cpu[req.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter

    def _adapter(self, lora_int_id: int) -> Adapter:
        adapter = self.cpu.get(lora_int_id)
        if adapter is None:  # evicted from the host cache: read it again
            return self._load(self.known[lora_int_id])
        self.cpu.move_to_end(lora_int_id)
        return adapter

    def refresh(self, clear_slots: bool = False) -> None:
        """Read the LoRA arrays again from the model (after the worker swapped arrays: a
        weight update or a wake-up); clear_slots: their contents are gone (zeros), so no
        adapter is resident any more."""
        self.arrays = {(p, ab): getattr(t.module, f"lora_{ab}").get_value()
                       for p, t in self.targets.items() for ab in ("a", "b")}
        if clear_slots:
            self.slot_of.clear()
            self.slot_ids = [None] * self.max_loras

    # -- the device slots ------------------------------------------------------------------------
    def activate(self, ids, params):
        """Put the adapters `ids` (lora_int_ids, each known) into slots. Returns (id -> slot,
        params with the LoRA arrays replaced where a slot was written, ids that failed to
        load -> error)."""
        ids = set(ids)
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step with {len(ids)} adapters exceeds max_loras="
                               f"{self.max_loras}")
        self._tick += 1
        failed: dict[int, str] = {}
        writes: dict[int, Adapter] = {}
        for i in sorted(ids):
            if i in self.slot_of:
                self.slot_last_use[self.slot_of[i]] = self._tick
                continue
            try:
                adapter = self._adapter(i)
            except (ValueError, KeyError) as e:
                failed[i] = str(e) if isinstance(e, ValueError) else f"unknown lora_int_id {i}"
                continue
            slot = min(range(self.max_loras), key=lambda s: (
                self.slot_ids[s] is not None, self.slot_last_use[s]))
            old = self.slot_ids[slot]
            if old is not None:
                del self.slot_of[old]
            self.slot_ids[slot], self.slot_of[i] = i, slot
            self.slot_last_use[slot] = self._tick
            writes[slot] = adapter
        if writes:
            params = self._write_slots(writes, params)
        return {i: self.slot_of[i] for i in ids if i in self.slot_of}, params, failed

    def _write_slots(self, writes: dict[int, Adapter], params):
        keys = list(self.arrays)
        olds = [self.arrays[k] for k in keys]
        axes = self.slot_axes
        if self._write is None:
            def write(arrays, slots, values):  # (slot index max_loras: padding, dropped)
                return [a.at[(slice(None),) * k + (slots,)].set(v, mode="drop")
                        for a, v, k in zip(arrays, values, axes)]

            self._write = jax.jit(write, out_shardings=[a.sharding for a in olds])
        # Always max_loras rows (one compiled shape): the slots written, then padding.
        slots = np.full(self.max_loras, self.max_loras, np.int32)
        slots[:len(writes)] = sorted(writes)
        values = []
        for (path, ab), old, k in zip(keys, olds, axes):
            shape = list(old.shape)
            shape[k] = self.max_loras
            rows = np.zeros(shape, self.dtype)
            for n, s in enumerate(slots[:len(writes)]):
                got = writes[int(s)].weights.get(path)
                if got is not None:
                    rows[(slice(None),) * k + (n,)] = got[0 if ab == "a" else 1]
            values.append(rows)
        news = self._write(olds, slots, values)
        self.num_slot_writes += len(writes)
        replace = {id(o): n for o, n in zip(olds, news)}
        self.arrays = dict(zip(keys, news))
        for (path, ab), new in self.arrays.items():
            getattr(self.targets[path].module, f"lora_{ab}").set_value(new)
        return jax.tree.map(lambda x: replace.get(id(x), x), params)
