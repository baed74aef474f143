"""Random PEFT adapters over tiny HF models (the reference: HF + peft in float64)."""

from __future__ import annotations

import copy
import json
import os

import pytest


def make_adapter(base_hf, out_dir, *, targets, r=8, alpha=16, rslora=False, seed=0,
                 float64=True, bf16=False, **extra):
    """A LoRA adapter over `base_hf` (an HF model) with random A and B (peft zeroes B at
    init: an adapter that changes nothing would test nothing), saved as safetensors in
    out_dir (bf16: its tensors in bfloat16). Returns the PEFT model in float64 (the
    reference; float64=False: float32, for HF's MoE layers, whose grouped matmul has no
    float64)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                          use_rslora=rslora, lora_dropout=0.0, **extra)
    model = peft.get_peft_model(copy.deepcopy(base_hf), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                if bf16:  # (saved as bfloat16; the reference keeps the rounded values)
                    p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return (model.double() if float64 else model).eval()


def edit_config(folder, **changes):
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
