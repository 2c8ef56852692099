#!/usr/bin/env bash
# Runs `anetrain bench` and the PyTorch equivalent back to back on the same
# machine and prints the ratio of median step times (>1: anetrain faster).
# Needs a Python environment with torch and transformers (see
# docs/benchmarks.md). Usage: scripts/bench_compare.sh MODEL [SEQ] [STEPS]
set -euo pipefail
model=${1:-stories110m}; seq=${2:-256}; steps=${3:-5}
py=${PYTHON:-.venv/bin/python}
cargo build --release -q
ours=$(./target/release/anetrain bench --model "$model" --seq "$seq" --steps "$steps" --backend cpu 2>/dev/null | tail -1)
theirs=$($py scripts/bench_pytorch.py --model "$model" --seq "$seq" --steps "$steps" 2>/dev/null | tail -1)
fused=$($py scripts/bench_pytorch.py --model "$model" --seq "$seq" --steps "$steps" --fused 2>/dev/null | tail -1)
echo "anetrain: $ours"
echo "pytorch:  $theirs"
echo "pytorch (fused AdamW): $fused"
$py - "$ours" "$theirs" "$fused" <<'PY'
import json, sys
o, t, f = (json.loads(s) for s in sys.argv[1:4])
print(f"speed ratio vs pytorch: {t['median_step_s'] / o['median_step_s']:.2f}x, "
      f"vs pytorch fused AdamW: {f['median_step_s'] / o['median_step_s']:.2f}x (>1 means anetrain is faster)")
PY
