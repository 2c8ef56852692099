#!/usr/bin/env python3
"""Checks that a model directory written by anetrain loads in `transformers`
unchanged and gives the logits `anetrain eval --logits-out` computed.

Usage: python scripts/check_hf_roundtrip.py MODEL_DIR TOKENS.npy LOGITS.npy
"""
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

model_dir, tokens, logits = sys.argv[1:4]
m = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
t = torch.from_numpy(np.load(tokens).astype(np.int64))
if t.dim() == 1:
    t = t[None]
with torch.no_grad():
    hf = m(input_ids=t[:, :-1]).logits.numpy()
ours = np.load(logits).reshape(hf.shape)
rel = np.abs(hf - ours).max() / np.abs(hf).max()
print(f"max relative difference {rel:.3e}")
sys.exit(0 if rel < 1e-5 else 1)
