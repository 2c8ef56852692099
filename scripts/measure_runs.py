#!/usr/bin/env python3
"""Measures the README's "What a run needs" rows: each run under
`/usr/bin/time -v`, its peak RSS (reported in KiB, printed here in GB of
10^9 bytes), the weights' bytes, the memory plan's estimate (the run's own
`note: memory plan:` line) and the wall time.

    cargo build --release
    python3 scripts/random_bf16_checkpoint.py testdata/configs/qwen3-0.6b.json /tmp/q06
    ./target/release/anetrain quantize --model /tmp/q06 --bits 4 --out /tmp/q06q4
    python3 scripts/measure_runs.py --q06 /tmp/q06 --q06q4 /tmp/q06q4 \
        [--q4b /tmp/q4b] [--q4b4 /tmp/q4b4]

The device runs pin `--device-buffers streamed`, which the default picks
only when the persistent buffers' plan exceeds a quarter of the memory
limit (so the default depends on the machine). The 4B rows are optional (minutes for the bf16 base, about twenty for the
4-bit one on the simulator). Every run trains one LoRA r16 step on random
token ids: one sequence of 256 tokens (the 4B shapes: 8 of 32).
"""
import argparse
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "anetrain"


def weights_bytes(model):
    return sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))


def measure(label, args, weights=None):
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-v", str(BIN)] + args, capture_output=True, text=True)
    wall = time.time() - t
    if p.returncode != 0:
        sys.exit(f"{label}: exit {p.returncode}\n{p.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    plan = re.search(r"note: memory plan: ([0-9.]+ [kMG]B) at peak", p.stderr)
    ratio = f"{rss / weights:.2f}×" if weights else "—"
    print(f"| {label} | {size(rss)} | {ratio} | {plan.group(1) if plan else '—'} | {wall:.0f} s |", flush=True)


def size(b):
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--q06", required=True, help="Qwen3-0.6B-shaped bf16 checkpoint")
    ap.add_argument("--q06q4", help="the same quantized to 4 bits by `anetrain quantize`")
    ap.add_argument("--q4b", help="Qwen3-4B-shaped bf16 checkpoint")
    ap.add_argument("--q4b4", help="the same quantized to 4 bits")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="measure-runs-"))
    try:
        measure_all(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure_all(a, tmp):
    rng = random.Random(0)
    data = tmp / "tokens.u32"
    data.write_bytes(struct.pack("<16384I", *(rng.randrange(151936) for _ in range(16384))))
    n = [0]

    def run(model, seq, batch, *flags):
        n[0] += 1
        return ["train", "--model", str(model), "--data", str(data), "--token-dtype", "u32",
                "--lora-rank", "16", "--seq", str(seq), "--batch", str(batch), "--steps", "1",
                "--eval-every", "0", "--out", str(tmp / f"run{n[0]}")] + list(flags)

    print("| run | peak RSS | × the weights' bytes | the memory plan said | wall time of the run here |")
    print("|---|---|---|---|---|")
    measure("`train` (the default: `tiny`, 300 steps)", ["train", "--out", str(tmp / "tiny")])
    w = weights_bytes(a.q06)
    measure("Qwen3-0.6B LoRA, `--backend cpu`", run(a.q06, 256, 1, "--backend", "cpu"), w)
    measure("Qwen3-0.6B LoRA, `--backend cpu --grad-checkpoint`",
            run(a.q06, 256, 1, "--backend", "cpu", "--grad-checkpoint"), w)
    measure("Qwen3-0.6B LoRA, `--backend ane-sim` (streamed buffers)",
            run(a.q06, 256, 1, "--backend", "ane-sim", "--device-buffers", "streamed"), w)
    measure("Qwen3-0.6B LoRA, `--backend ane-sim --grad-checkpoint` (streamed buffers)",
            run(a.q06, 256, 1, "--backend", "ane-sim", "--grad-checkpoint", "--device-buffers", "streamed"), w)
    if a.q06q4:
        measure(f"Qwen3-0.6B 4-bit (`anetrain quantize`, {size(weights_bytes(a.q06q4))}) LoRA, `--backend cpu`",
                run(a.q06q4, 256, 1, "--backend", "cpu"), weights_bytes(a.q06q4))
    if a.q4b:
        measure("Qwen3-4B LoRA, seq 32, batch 8, `--backend ane-sim --grad-checkpoint`",
                run(a.q4b, 32, 8, "--backend", "ane-sim", "--grad-checkpoint"), weights_bytes(a.q4b))
    if a.q4b4:
        w4 = weights_bytes(a.q4b4)
        measure(f"Qwen3-4B 4-bit (`anetrain quantize`, {size(w4)}) LoRA, seq 32, batch 8, "
                "`--backend ane-sim --grad-checkpoint`",
                run(a.q4b4, 32, 8, "--backend", "ane-sim", "--grad-checkpoint"), w4)


if __name__ == "__main__":
    main()
