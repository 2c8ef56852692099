#!/usr/bin/env python3
"""Counts the parameters `transformers` builds for every published config in
testdata/configs/ (on the meta device: no memory, no weights) and writes
them to testdata/configs/params.json, which the config tests compare with
anetrain's own count (`ModelConfig::num_params`) — so each published
checkpoint shape is checked to be read as transformers reads it.

    python3 scripts/count_params.py
"""
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "testdata" / "configs"


def count(path):
    d = json.loads(path.read_text())
    cfg = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "quantization"})
    if d.get("model_type") == "gemma3":  # the multimodal checkpoint: its text model
        cfg = cfg.get_text_config()
        cfg.architectures = ["Gemma3ForCausalLM"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def main():
    counts = {}
    for path in sorted(ROOT.glob("*.json")):
        if path.name == "params.json" or "quantization" in json.loads(path.read_text()):
            continue
        counts[path.stem] = count(path)
        print(f"{path.stem}: {counts[path.stem]:,}")
    (ROOT / "params.json").write_text(json.dumps(counts, indent=1) + "\n")


if __name__ == "__main__":
    main()
