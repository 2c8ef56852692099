#!/usr/bin/env python3
"""Checks that an anetrain run directory is a complete Hugging Face model:
AutoTokenizer and AutoModelForCausalLM load it, the tokenizer round-trips
text, config.json's eos_token_id is the tokenizer's end token, and the
model's greedy continuation of a prompt can be decoded.

Usage: python scripts/check_run_dir.py RUN_DIR
"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

run = sys.argv[1]
tok = AutoTokenizer.from_pretrained(run)
model = AutoModelForCausalLM.from_pretrained(run).float().eval()
text = "Once upon a time, there was a little dog."
ids = tok(text)["input_ids"]
assert tok.decode(ids) == text, (tok.decode(ids), text)
assert tok.eos_token is not None, "the tokenizer has no eos_token"
assert model.config.eos_token_id == tok.eos_token_id, (model.config.eos_token_id, tok.eos_token_id)
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
print(f"eos {tok.eos_token!r} = {tok.eos_token_id}; continuation: {tok.decode(out[0][len(ids):])!r}")
print("ok")
