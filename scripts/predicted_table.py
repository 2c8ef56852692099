#!/usr/bin/env python3
"""Prints docs/benchmarks.md's tables of predicted steps: `anetrain kernels
plan --json` for Qwen3-0.6B/1.7B/4B at seq 256/1024/4096, full fine-tuning
and LoRA rank 16, on the M1, M4 and M5 rows of the cost model; with
`--families`, one shape of each model family (LoRA r16, seq 1024, streamed
device buffers) with its memory plan; with `--energy`, tokens a second and
millijoules a token of LoRA recipes people run with mlx-lm on the GPU.

    cargo build --release && python3 scripts/predicted_table.py [--families | --energy]
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "anetrain"
MODELS = [("Qwen3-0.6B", "qwen3-0.6b"), ("Qwen3-1.7B", "qwen3-1.7b"), ("Qwen3-4B", "qwen3-4b")]


FAMILIES = [("Gemma-3-270M", "gemma-3-270m"), ("Gemma-3-1B", "gemma-3-1b"),
            ("Qwen3-0.6B", "qwen3-0.6b"), ("Qwen2.5-0.5B", "qwen2.5-0.5b"),
            ("OLMo-2-1B", "olmo-2-1b"), ("Gemma-2-2B", "gemma-2-2b"),
            ("Granite-3.3-2B", "granite-3.3-2b"), ("SmolLM3-3B", "smollm3-3b"),
            ("Llama-3.2-3B", "llama-3.2-3b"), ("Phi-4-mini", "phi-4-mini"),
            ("Mistral-7B-v0.3", "mistral-7b-v0.3")]


def plan(config, seq, lora, *extra):
    args = [str(BIN), "kernels", "plan", "--model", str(ROOT / "testdata/configs" / f"{config}.json"),
            "--seq", str(seq), "--json", "--grad-checkpoint", "--max-memory", "1T", *extra]
    if lora:
        args += ["--lora-rank", "16"]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def ms(p):
    """A family's ms/step; where its published curves disagree (the M1's
    two), the range from the table's curve to the other."""
    other = p.get("other_curve")
    return f"{p['step_ms']:,.0f}" + (f"–{other[1]:,.0f}" if other else "")


def families():
    print("| model (bf16 base) | " + " | ".join(f"{f} ms/step (tok/s)" for f in ("m1", "m4", "m5")) +
          " | evaluations | memory plan |")
    print("|---|" + "---:|" * 5)
    for name, config in FAMILIES:
        v = plan(config, 1024, True, "--device-buffers", "streamed", "--backend", "ane-sim")
        p = v["predicted"]
        cells = [f"{ms(p[f])} ({p[f]['tokens_per_s']:,.0f})" for f in ("m1", "m4", "m5")]
        print(f"| {name} | " + " | ".join(cells) +
              f" | {p['m4']['evaluations']:,} | {v['memory']['total'] / 1e9:.2f} GB |")
    return 0


ENERGY = [("Qwen3-0.6B", "qwen3-0.6b", 256, []),
          ("Qwen3-0.6B", "qwen3-0.6b", 1024, []),
          ("Qwen3-0.6B", "qwen3-0.6b", 1024, ["--lora-layers", "16"]),
          ("Qwen3-4B", "qwen3-4b", 1024, []),
          ("Qwen3-4B", "qwen3-4b", 1024, ["--lora-layers", "16"]),
          ("Mistral-7B-v0.3", "mistral-7b-v0.3", 1024, ["--lora-layers", "16"])]


def energy():
    print("| model, LoRA r16, streamed buffers | seq | layers adapted | " +
          " | ".join(f"{f} tok/s, mJ/token" for f in ("m1", "m4", "m5")) + " |")
    print("|---|---:|---|" + "---:|" * 3)
    for name, config, seq, extra in ENERGY:
        args = [str(BIN), "kernels", "plan", "--model", str(ROOT / "testdata/configs" / f"{config}.json"),
                "--seq", str(seq), "--json", "--lora-rank", "16", "--device-buffers", "streamed",
                "--max-memory", "1T", *extra]
        p = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)["predicted"]
        cells = [f"{p[f]['tokens_per_s']:,.0f}, {p[f]['mj_per_token']:,.0f}" for f in ("m1", "m4", "m5")]
        print(f"| {name} | {seq} | {'last ' + extra[1] if extra else 'all'} | " + " | ".join(cells) + " |")
    return 0


def main():
    if "--families" in sys.argv[1:]:
        return families()
    if "--energy" in sys.argv[1:]:
        return energy()
    print("| model | seq | training | evaluations | " +
          " | ".join(f"{f} ms/step (tok/s, dominant)" for f in ("m1", "m4", "m5")) + " |")
    print("|---|---:|---|---:|" + "---|" * 3)
    for name, config in MODELS:
        for seq in (256, 1024, 4096):
            for lora in (False, True):
                p = plan(config, seq, lora)["predicted"]
                cells = [f"{ms(p[f])} ({p[f]['tokens_per_s']:,.0f}, {p[f]['dominant']})"
                         for f in ("m1", "m4", "m5")]
                print(f"| {name} | {seq} | {'LoRA r16' if lora else 'full'} | "
                      f"{p['m4']['evaluations']:,} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
