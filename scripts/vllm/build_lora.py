#!/usr/bin/env python3
"""Build tiny random-weight LoRA adapters (peft format) for the tiny Llama of build_model.py, offline.

Run it with the vLLM venv's python (it needs ``torch`` and ``safetensors``)::

    .cache/vllm-venv/bin/python scripts/vllm/build_lora.py      # -> .cache/vllm-model/lora-a1, lora-a2

Each adapter is what peft's ``save_pretrained`` writes for a LoRA on q_proj and v_proj: an ``adapter_config.json``
and an ``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.N.self_attn.{q,v}_proj.lora_{A,B}.weight`` with shapes [r, in] and [out, r].
The weights are random (a fixed seed per adapter): the adapters exist to exercise vLLM's LoRA serving paths
(cards, names, load/unload, metrics), not to change what the model says in any meaningful way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "vllm-model"
RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
ADAPTERS = {"lora-a1": 1, "lora-a2": 2}  # folder -> seed


def adapter_config(base: Path) -> dict:
    return {
        "base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(TARGETS), "modules_to_save": None, "inference_mode": True,
    }


def build(out: Path, base: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = hidden // heads
    out_dims = {"q_proj": heads * head_dim, "v_proj": cfg.get("num_key_value_heads", heads) * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dims[mod], RANK, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(base), indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=MODEL_DIR / "tiny-llama", help="the base model folder")
    ap.add_argument("--out", type=Path, default=MODEL_DIR, help="parent folder of the adapters")
    args = ap.parse_args(argv)
    for name, seed in ADAPTERS.items():
        target = args.out.resolve() / name
        if (target / "adapter_config.json").is_file() and (target / "adapter_model.safetensors").is_file():
            print(f"[build_lora] reusing {target}")
            continue
        build(target, args.base.resolve(), seed)
        print(f"[build_lora] built {target} (r={RANK}, {', '.join(TARGETS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
