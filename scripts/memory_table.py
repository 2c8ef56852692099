#!/usr/bin/env python3
"""Prints the README's memory table: the memory plan's peak estimate
(`anetrain kernels plan --json`) for each model shape in testdata/configs,
full fine-tuning and LoRA rank 16, at several sequence lengths, on the
Neural Engine with streamed device buffers, with and without
--grad-checkpoint. A LoRA base is counted memory-mapped in bf16, as
published (a 4-bit base at its quantized size); full fine-tuning holds
f32 master weights, gradients and AdamW moments.

    cargo build --release && python3 scripts/memory_table.py

A cell is '-' where the device kernels cannot run that length yet.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "anetrain"
MODELS = ["qwen3-0.6b", "qwen3-1.7b", "llama-3.2-3b", "qwen3-4b"]
# MLX 4-bit bases (groups of 64, bf16 scales, as mlx-community publishes
# them): LoRA only.
QUANTIZED = ["qwen3-4b-4bit", "qwen3-8b-4bit"]
SEQS = [256, 1024, 2048]


def plan(model, seq, lora, ckpt):
    args = [str(BIN), "kernels", "plan", "--model", str(ROOT / "testdata" / "configs" / f"{model}.json"),
            "--seq", str(seq), "--backend", "ane", "--device-buffers", "streamed", "--json"]
    if lora:
        args += ["--lora-rank", "16"]
    if ckpt:
        args += ["--grad-checkpoint"]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout)["memory"]["total"] / 1e9


def main():
    if not BIN.is_file():
        sys.exit(f"{BIN} not found: run `cargo build --release` first")
    head = ["model", "training"] + [f"seq {s}" for s in SEQS] + [f"seq {s}, --grad-checkpoint" for s in SEQS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for m in MODELS + QUANTIZED:
        for lora in (True, False) if m in MODELS else (True,):
            cells = []
            for ckpt in (False, True):
                for s in SEQS:
                    gb = plan(m, s, lora, ckpt)
                    cells.append("-" if gb is None else f"{gb:.1f} GB")
            print(f"| {m} | {'LoRA r16' if lora else 'full'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
