#!/usr/bin/env python3
"""Checks that a LoRA run anetrain trained on an MLX-quantized base loads
in mlx-lm and gives the logits `anetrain eval --adapter --logits-out`
computed: mlx-lm's model dequantized and run in f32 (what anetrain
computes), the run's adapters.safetensors loaded by mlx-lm's own loader.

Usage: python scripts/check_mlx_qlora.py BASE RUN TOKENIZER_DIR TOKENS.npy LOGITS.npy
  BASE           the quantized model directory (mlx_lm.convert -q's output)
  RUN            the LoRA run directory
  TOKENIZER_DIR  a directory holding tokenizer.json (mlx-lm loads one with
                 any model)
  TOKENS.npy     int64 [1, n+1]; LOGITS.npy the logits of its first n

Example (the MLX fixtures, needs mlx[cpu] and mlx-lm):
  anetrain train --model testdata/mlx/qwen2-q4-g64-bf16 \\
      --tokenizer testdata/chat/model/tokenizer.json \\
      --data testdata/chat/data/chat --lora-rank 4 --seq 64 --steps 10 \\
      --backend ane-sim --out /tmp/ql
  anetrain eval --model testdata/mlx/qwen2-q4-g64-bf16 --adapter /tmp/ql \\
      --tokens toks.npy --logits-out ours.npy
  python scripts/check_mlx_qlora.py testdata/mlx/qwen2-q4-g64-bf16 /tmp/ql \\
      testdata/chat/model toks.npy ours.npy
"""
import os
import shutil
import sys
import tempfile

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import dequantize_model

base, run, tok_dir, tokens, logits = sys.argv[1:6]
with tempfile.TemporaryDirectory() as d:
    model_dir = os.path.join(d, "model")
    shutil.copytree(base, model_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tok_dir, f)):
            shutil.copy(os.path.join(tok_dir, f), model_dir)
    model, _ = load(model_dir)
model = dequantize_model(model)
model.set_dtype(mx.float32)
model = load_adapters(model, run)
t = np.load(tokens).astype(np.int64)
if t.ndim == 1:
    t = t[None]
ref = np.array(model(mx.array(t[:, :-1])).astype(mx.float32))
ours = np.load(logits).reshape(ref.shape)
rel = np.abs(ref - ours).max() / np.abs(ref).max()
print(f"max relative difference {rel:.3e}")
sys.exit(0 if rel < 1e-5 else 1)
