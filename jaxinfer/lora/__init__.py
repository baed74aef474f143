"""Multi-LoRA serving: LoRARequest (what a request names), the PEFT adapter reader
(adapter.py) and the worker's slots and host cache (manager.py); the layers' side is
layers/lora.py."""
