"""LoRARequest: vLLM's (jaxinfer.lora.request.LoRARequest as vllm.lora.request.LoRARequest).
It crosses to the engine core inside an EngineCoreRequest (a msgspec struct)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """An adapter a request runs with: a name, a positive integer id (unique per adapter:
    the engine keys its slots and caches on it) and a PEFT folder (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or not 1 <= self.lora_int_id <= 2**31 - 1:
            raise ValueError(f"lora_int_id must be an integer in [1, 2**31 - 1], got "
                             f"{self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
