#!/usr/bin/env python3
"""Prints docs/benchmarks.md's table of where a training step's arithmetic
goes on the Neural Engine path, from the plan (`anetrain kernels plan
--json`), for Qwen3 shapes at several sequence lengths: FLOPs on the device
(every tile program's matrix products, the LM head's chunks included),
device evaluations, the host's critical path (the loss's softmax between
the head's chunks), full fine-tuning's weight gradients beside the device
(the head's among them), and the largest surface a tile uses.
LoRA rank 16 on all seven projections; batch 1.

    cargo build --release && python3 scripts/work_table.py
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "anetrain"
MODELS = [("Qwen3-0.6B", "qwen3-0.6b"), ("Qwen3-1.7B", "qwen3-1.7b"), ("Qwen3-4B", "qwen3-4b")]
SEQS = [256, 1024, 4096]


def plan(model, seq, lora):
    args = [str(BIN), "kernels", "plan", "--model", str(ROOT / "testdata" / "configs" / f"{model}.json"),
            "--seq", str(seq), "--json"]
    if lora:
        args += ["--lora-rank", "16"]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{model} at {seq}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def main():
    if not BIN.is_file():
        sys.exit(f"{BIN} not found: run `cargo build --release` first")
    print("| model | seq | device GFLOP | device evaluations | LM head chunks | host GFLOP (critical path) | host / device | full fine-tuning: weight gradients GFLOP | largest tile surface |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, model in MODELS:
        for seq in SEQS:
            p = plan(model, seq, True)
            w = p["work"]
            full = plan(model, seq, False)["work"]
            largest = max(2 * max(k["input"][0] * k["input"][1], k["output"][0] * k["output"][1])
                          for k in p["plan"]["kernels"])
            print(f"| {name} | {seq} | {w['device_flop'] / 1e9:,.0f} | {w['device_evaluations']:,} | "
                  f"{p['plan']['head']['chunks']} × {p['plan']['head']['rows']} | "
                  f"{w['host_flop'] / 1e9:,.1f} | {100 * w['host_flop'] / w['device_flop']:.2f}% | "
                  f"{full['host_weight_gradient_flop'] / 1e9:,.0f} | {largest / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
