#!/usr/bin/env python3
"""Prints docs/benchmarks.md's table of predicted steps: `anetrain kernels
plan --json` for Qwen3-0.6B/1.7B/4B at seq 256/1024/4096, full fine-tuning
and LoRA rank 16, on the M1, M4 and M5 rows of the cost model.

    cargo build --release && python3 scripts/predicted_table.py
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "anetrain"
MODELS = [("Qwen3-0.6B", "qwen3-0.6b"), ("Qwen3-1.7B", "qwen3-1.7b"), ("Qwen3-4B", "qwen3-4b")]


def plan(config, seq, lora):
    args = [str(BIN), "kernels", "plan", "--model", str(ROOT / "testdata/configs" / f"{config}.json"),
            "--seq", str(seq), "--json", "--grad-checkpoint", "--max-memory", "1T"]
    if lora:
        args += ["--lora-rank", "16"]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    print("| model | seq | training | evaluations | " +
          " | ".join(f"{f} ms/step (tok/s, dominant)" for f in ("m1", "m4", "m5")) + " |")
    print("|---|---:|---|---:|" + "---|" * 3)
    for name, config in MODELS:
        for seq in (256, 1024, 4096):
            for lora in (False, True):
                p = plan(config, seq, lora)["predicted"]
                cells = [f"{p[f]['step_ms']:,.0f} ({p[f]['tokens_per_s']:,.0f}, {p[f]['dominant']})"
                         for f in ("m1", "m4", "m5")]
                print(f"| {name} | {seq} | {'LoRA r16' if lora else 'full'} | "
                      f"{p['m4']['evaluations']:,} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
