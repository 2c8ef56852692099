#!/usr/bin/env python3
"""An adapter trained by mlx-lm, and mlx-lm running ours: testdata/mlx/adapter.

1. Trains a LoRA adapter with `mlx_lm.lora` (mlx's CPU backend) on the
   4-bit fixture base testdata/mlx/q4-g32-f32 and the chat test records
   (the last of its two layers, as mlx-lm's `--num-layers` adapts the last
   ones; rank 8, mlx-lm's default scale of 20), and records the
   logits mlx-lm's model computes with it on the fixture tokens:
   testdata/mlx/adapter/{adapters.safetensors, adapter_config.json,
   expected.safetensors}. `cargo test` loads it and compares.
2. Trains an adapter with anetrain on the same base (needs a release build)
   and loads it in mlx-lm (`load(base, adapter_path=run)`), comparing
   mlx-lm's logits with `anetrain eval --adapter --logits-out`; prints the
   difference (recorded in docs/cli.md).

Run from the repository root: python3 scripts/make_mlx_adapter_fixture.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np
from mlx_lm import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "testdata", "mlx", "q4-g32-f32")
CHAT = os.path.join(ROOT, "testdata", "chat")
OUT = os.path.join(ROOT, "testdata", "mlx", "adapter")
BINARY = os.path.join(ROOT, "target", "release", "anetrain")
TOKENS = json.load(open(os.path.join(ROOT, "testdata", "mlx", "expected.json")))["tokens"]


def base_with_tokenizer(tmp):
    """The fixture base with the chat model's tokenizer beside it."""
    d = os.path.join(tmp, "base")
    shutil.copytree(BASE, d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(CHAT, "model", f), d)
    return d


def logits(model):
    return np.array(model(mx.array([TOKENS]))[0].astype(mx.float32))


def main():
    with tempfile.TemporaryDirectory() as tmp:
        base = base_with_tokenizer(tmp)
        shutil.rmtree(OUT, ignore_errors=True)
        cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", base, "--train"]
        cmd += ["--data", os.path.join(CHAT, "data", "chat"), "--iters", "20"]
        cmd += ["--batch-size", "2", "--num-layers", "1", "--learning-rate", "1e-3"]
        cmd += ["--adapter-path", OUT, "--seed", "0", "--max-seq-length", "128"]
        subprocess.run(cmd, check=True, capture_output=True)
        for f in os.listdir(OUT):
            if f not in ("adapters.safetensors", "adapter_config.json"):
                os.remove(os.path.join(OUT, f))
        # Paths of this machine out of the committed config.
        config_path = os.path.join(OUT, "adapter_config.json")
        config = json.load(open(config_path))
        config.update(model="testdata/mlx/q4-g32-f32", adapter_path="testdata/mlx/adapter",
                      data="testdata/chat/data/chat")
        json.dump(config, open(config_path, "w"), indent=4)
        model, _ = load(base, adapter_path=OUT)
        mx.save_safetensors(
            os.path.join(OUT, "expected.safetensors"), {"logits": mx.array(logits(model))}
        )
        print("mlx-lm adapter:", json.load(open(os.path.join(OUT, "adapter_config.json")))["lora_parameters"])

        if not os.path.isfile(BINARY):
            sys.exit(f"needs {BINARY} for the second check: cargo build --release")
        run = os.path.join(tmp, "run")
        train = [BINARY, "train", "--model", base, "--data", os.path.join(CHAT, "data", "chat")]
        train += ["--lora-rank", "8", "--lora-layers", "1", "--steps", "10", "--seq", "64", "--lr", "1e-2"]
        train += ["--eval-every", "0", "--backend", "cpu", "--out", run]
        subprocess.run(train, check=True, capture_output=True)
        toks, out = os.path.join(tmp, "t.npy"), os.path.join(tmp, "l.npy")
        np.save(toks, np.array([TOKENS], dtype=np.int64))
        ev = [BINARY, "eval", "--model", base, "--adapter", run, "--tokens", toks]
        subprocess.run(ev + ["--logits-out", out, "--backend", "cpu"], check=True, capture_output=True)
        ours = np.load(out).reshape(len(TOKENS) - 1, -1)
        model, _ = load(base, adapter_path=run)
        theirs = logits(model)[:-1]
        err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        print(f"anetrain's adapter in mlx-lm: logits max relative difference {err:.2e}")
        assert err < 1e-5, err


if __name__ == "__main__":
    main()
