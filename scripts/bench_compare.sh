#!/usr/bin/env bash
# Runs `anetrain bench` and the PyTorch equivalent (default and fused AdamW)
# back to back, ROUNDS times in turn, and prints each round's ratios of
# median step times (>1: anetrain faster) and their median. Taking turns
# matters on shared machines: a noisy spell then hits every engine alike,
# and `host_steal_fraction` shows how much CPU time the hypervisor took.
# Needs a Python environment with torch and transformers (see
# docs/benchmarks.md).
# Usage: scripts/bench_compare.sh MODEL [SEQ] [STEPS] [ROUNDS]
set -euo pipefail
model=${1:-stories110m}; seq=${2:-256}; steps=${3:-5}; rounds=${4:-3}
py=${PYTHON:-.venv/bin/python}
cargo build --release -q
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for r in $(seq "$rounds"); do
    ours=$(./target/release/anetrain bench --model "$model" --seq "$seq" --steps "$steps" --backend cpu 2>/dev/null | tail -1)
    theirs=$($py scripts/bench_pytorch.py --model "$model" --seq "$seq" --steps "$steps" 2>/dev/null | tail -1)
    fused=$($py scripts/bench_pytorch.py --model "$model" --seq "$seq" --steps "$steps" --fused 2>/dev/null | tail -1)
    echo "round $r anetrain: $ours"
    echo "round $r pytorch:  $theirs"
    echo "round $r pytorch (fused AdamW): $fused"
    printf '%s\t%s\t%s\n' "$ours" "$theirs" "$fused" >>"$log"
done
$py - "$log" <<'PY'
import json, statistics, sys
rows = [[json.loads(c) for c in line.rstrip("\n").split("\t")] for line in open(sys.argv[1])]
def steal(d):
    s = d.get("host_steal_fraction")
    return "n/a" if s is None else f"{s:.0%}"
vs, vf = [], []
for i, (o, t, f) in enumerate(rows, 1):
    vs.append(t["median_step_s"] / o["median_step_s"])
    vf.append(f["median_step_s"] / o["median_step_s"])
    print(f"round {i}: anetrain {o['median_step_s']:.3f} s (steal {steal(o)}), pytorch {t['median_step_s']:.3f} s "
          f"(steal {steal(t)}), fused {f['median_step_s']:.3f} s (steal {steal(f)}): "
          f"{vs[-1]:.2f}x / {vf[-1]:.2f}x; best matmul {o['matmul_gflops']:.0f} vs torch "
          f"{t['matmul_gflops']:.0f} GFLOP/s")
    if o.get("products_only_s"):
        print(f"  anetrain's matrix products alone take {o['products_only_s']:.3f} s "
              f"(step = {o['step_over_products']:.2f}x that); 1.6x / 1.4x fused AdamW "
              f"would need a {f['median_step_s'] / 1.6:.3f} / {f['median_step_s'] / 1.4:.3f} s step")
print(f"median over {len(rows)} rounds: {statistics.median(vs):.2f}x vs pytorch, "
      f"{statistics.median(vf):.2f}x vs pytorch fused AdamW (>1 means anetrain is faster)")
PY
