#!/usr/bin/env python3
"""Checks the hand-off between anetrain and PyTorch's distributed training
both ways (scripts/continue_in_torch.py), on small Hugging Face models from
testdata/, for three kinds of run: chat records with --mask-prompt, a token
file with random windows, and LoRA on chat records.

For each: train 10 steps with anetrain (constant learning rate, --batch 2),
then
  (a) anetrain train --resume --steps 15
  (b) torchrun --nproc_per_node 1 continue_in_torch.py --steps 5
  (c) torchrun --nproc_per_node 2 (gloo, CPU, loopback) --steps 5
and compare the five losses of (b) and (c) with (a) (relative, limit 1e-4)
and the final weights (max |difference| / max |entry|, limit 1e-4); then
resume (c)'s output in anetrain for 5 more steps and compare with (a)
resumed to 20 the same way.

Usage: python scripts/check_handoff.py [ANETRAIN_BINARY]   (run from the
repository root, in an environment with torch, transformers, peft; prints a
markdown table, exits 1 if a limit is broken)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "release", "anetrain")
LIMIT = 1e-4


def sh(*args, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, args))}\n{r.stderr}")
    return r.stdout


def losses(run, first, last):
    out = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("split") == "train" and first <= r["step"] <= last:
                out[r["step"]] = r["loss"]
    return [out[k] for k in range(first, last + 1)]


def weights(run):
    name = "adapter_model.safetensors" if os.path.exists(os.path.join(run, "adapter_model.safetensors")) \
        else "model.safetensors"
    return load_file(os.path.join(run, name))


def compare(la, lb, wa, wb):
    rel = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
    top = max(float(np.abs(v).max()) for v in wa.values())
    diff = max(float(np.abs(wa[k] - wb[k]).max()) for k in wa)
    return rel, diff / top


def scenario(name, flags, tmp):
    d = os.path.join(tmp, name)
    run = os.path.join(d, "run")
    sh(BIN, "train", *flags, "--steps", 10, "--out", run)
    a = os.path.join(d, "a")
    shutil.copytree(run, a)
    sh(BIN, "train", *flags, "--steps", 15, "--resume", "--out", a)
    la = losses(a, 11, 15)
    rows = []
    torch_runs = {}
    for p in (1, 2):
        out = os.path.join(d, f"torch{p}")
        text = sh(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", p,
                  "--master_addr", "127.0.0.1", "--master_port", 29500 + p,
                  os.path.join(ROOT, "scripts", "continue_in_torch.py"), run, "--steps", 5, "--out", out,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        lt = [json.loads(l)["loss"] for l in text.splitlines() if l.startswith("{")]
        rel, w = compare(la, lt, weights(a), weights(out))
        rows.append((name, f"torchrun P={p}, steps 11-15 vs anetrain --resume", rel, w))
        torch_runs[p] = out
    # Back: the P=2 output resumes in anetrain, against (a) continued.
    sh(BIN, "train", *flags, "--steps", 20, "--resume", "--out", torch_runs[2])
    sh(BIN, "train", *flags, "--steps", 20, "--resume", "--out", a)
    rel, w = compare(losses(a, 16, 20), losses(torch_runs[2], 16, 20), weights(a), weights(torch_runs[2]))
    rows.append((name, "anetrain --resume of the P=2 output, steps 16-20", rel, w))
    return rows


def main():
    common = ["--backend", "cpu", "--batch", "2", "--lr", "1e-3", "--warmup", "0", "--min-lr-frac", "1",
              "--eval-every", "0"]
    chat_model = os.path.join(ROOT, "testdata", "chat", "model")
    chat_data = os.path.join(ROOT, "testdata", "chat", "data", "chat")
    with tempfile.TemporaryDirectory(prefix="anetrain-handoff-") as tmp:
        tokens = os.path.join(tmp, "tokens.bin")
        np.random.default_rng(3).integers(0, 128, 20000).astype("<u2").tofile(tokens)
        cases = {
            "chat records, --mask-prompt": ["--model", chat_model, "--data", chat_data, "--mask-prompt",
                                            "--seq", "128"] + common,
            "token file, random windows": ["--model", os.path.join(ROOT, "testdata", "fixtures", "qwen3", "model"),
                                           "--data", tokens, "--seq", "48", "--accum", "2"] + common,
            "LoRA rank 8, chat records": ["--model", chat_model, "--data", chat_data, "--mask-prompt",
                                          "--seq", "128", "--lora-rank", "8"] + common,
        }
        rows = []
        for i, (name, flags) in enumerate(cases.items()):
            rows += [(name,) + r[1:] for r in scenario(f"case{i}", flags, tmp)]
    print("| run | comparison | max relative loss difference | max weight difference / max weight |")
    print("|---|---|---|---|")
    ok = True
    for name, what, rel, w in rows:
        ok &= rel < LIMIT and w < LIMIT
        print(f"| {name} | {what} | {rel:.1e} | {w:.1e} |")
    print(f"\nlimits {LIMIT:g}: {'all within' if ok else 'BROKEN'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
