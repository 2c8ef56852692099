#!/usr/bin/env python3
"""Checks that a LoRA adapter written by anetrain (`train --lora-rank`)
loads with `peft.PeftModel.from_pretrained` onto its `transformers` base
and gives the logits `anetrain eval --adapter --logits-out` computed.

Usage: python scripts/check_peft_roundtrip.py BASE_DIR ADAPTER_DIR TOKENS.npy LOGITS.npy
"""
import sys

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

base_dir, adapter_dir, tokens, logits = sys.argv[1:5]
base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").float()
m = PeftModel.from_pretrained(base, adapter_dir).eval()
t = torch.from_numpy(np.load(tokens).astype(np.int64))
if t.dim() == 1:
    t = t[None]
with torch.no_grad():
    hf = m(input_ids=t[:, :-1]).logits.numpy()
    with m.disable_adapter():
        no_adapter = m(input_ids=t[:, :-1]).logits.numpy()
ours = np.load(logits).reshape(hf.shape)
rel = np.abs(hf - ours).max() / np.abs(hf).max()
effect = np.abs(hf - no_adapter).max() / np.abs(hf).max()
print(f"max relative difference {rel:.3e} (the adapter itself moves logits by {effect:.3e})")
sys.exit(0 if rel < 1e-5 and effect > 1e-3 else 1)
