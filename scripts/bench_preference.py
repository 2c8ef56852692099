#!/usr/bin/env python3
"""Preference tuning on the CPU, measured: a Qwen3-0.6B-shape LoRA (rank 16,
every projection) DPO step against the SFT step of the same two sequences
(peak RSS from /usr/bin/time -v, seconds per step from metrics.jsonl), and
TRL 1.16's DPOTrainer on the same model, pairs and LoRA in the same run
(PyTorch fp32, seconds per step from a callback).

    python3 scripts/random_bf16_checkpoint.py testdata/configs/qwen3-0.6b.json /tmp/q06
    cargo build --release
    python3 scripts/bench_preference.py /tmp/q06 [STEPS] [REPEATS]

The model directory gets testdata/chat/model's tokenizer (its ids fit any
vocabulary) if it has none. Each sequence is a prompt of about 240 tokens
and a short answer; --seq 256. Needs torch, transformers, peft, trl.
"""
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target/release/anetrain")
MODEL = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
SEQ = 256


def data(dir):
    rng = random.Random(3)
    pairs, sft = [], []
    for _ in range(16):
        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
        ctx = " ".join(f"What is {rng.randrange(10, 99)} plus {rng.randrange(10, 99)}?" for _ in range(22))
        prompt = f"{ctx} Now: what is {a} plus {b}?"
        good, bad = f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {a + b + 1}."
        pairs.append({"prompt": [{"role": "user", "content": prompt}],
                      "chosen": [{"role": "assistant", "content": good}],
                      "rejected": [{"role": "assistant", "content": bad}]})
        sft.append({"prompt": prompt, "completion": good})
    for name, recs in (("dpo", pairs), ("sft", sft)):
        os.makedirs(os.path.join(dir, name), exist_ok=True)
        with open(os.path.join(dir, name, "train.jsonl"), "w") as f:
            f.write("\n".join(json.dumps(r) for r in recs))
    return pairs


REPEATS = int(sys.argv[3]) if len(sys.argv) > 3 else 3


def ours(dir, name, extra):
    """Median seconds per step and the peak RSS of each of REPEATS runs
    (glibc's arenas make the peak vary from run to run)."""
    runs = [once(dir, f"{name}-{k}", extra) for k in range(REPEATS)]
    times = sorted(t for _, t in runs)
    return sorted(r for r, _ in runs), times[len(times) // 2]


def once(dir, name, extra):
    out = os.path.join(dir, f"run-{name}")
    cmd = ["/usr/bin/time", "-v", BIN, "train", "--model", MODEL, "--lora-rank", "16", "--seq", str(SEQ),
           "--steps", str(STEPS), "--eval-every", "0", "--backend", "cpu", "--out", out] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"train"' in l]
    # The first step warms up; the median of the others.
    times = sorted(s["time"]["total"] for s in steps[1:])
    return rss, times[len(times) // 2]


def trl_step_seconds(pairs, checkpointing):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    marks = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks[-1] = time.perf_counter() - marks[-1]

    args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=STEPS,
                     learning_rate=2e-4, report_to=[], bf16=False, use_cpu=True, save_strategy="no",
                     max_length=SEQ + 1, logging_steps=1, gradient_checkpointing=checkpointing)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok,
                         peft_config=lora, callbacks=[Clock()])
    trainer.train()
    shutil.rmtree(args.output_dir, ignore_errors=True)
    times = sorted(marks[1:])
    return times[len(times) // 2], torch.__version__, torch.get_num_threads()


def main():
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if not os.path.exists(os.path.join(MODEL, f)):
            shutil.copy(os.path.join(ROOT, "testdata/chat/model", f), MODEL)
    dir = tempfile.mkdtemp()
    pairs = data(dir)
    sft_rss, sft_s = ours(dir, "sft", ["--data", os.path.join(dir, "sft"), "--mask-prompt", "--batch", "2"])
    dpo_rss, dpo_s = ours(dir, "dpo", ["--data", os.path.join(dir, "dpo"), "--objective", "dpo", "--batch", "1"])
    pre_rss, pre_s = ours(dir, "dpo-pre", ["--data", os.path.join(dir, "dpo"), "--objective", "dpo", "--batch", "1",
                                           "--precompute-ref"])
    # TRL's default recomputes activations in the backward
    # (gradient_checkpointing=True); ours keeps them unless asked.
    trl_gc, torch_version, threads = trl_step_seconds(pairs, True)
    trl_s, _, _ = trl_step_seconds(pairs, False)
    shutil.rmtree(dir, ignore_errors=True)
    print(f"Qwen3-0.6B shape, LoRA r16 on every projection, seq {SEQ}, one pair (two sequences) a step, "
          f"{STEPS} steps (median of steps 2..), torch {torch_version} with {threads} threads")
    gb = lambda rss: " / ".join(f"{r / 1e9:.2f}" for r in rss) + " GB"
    print(f"| run | s/step | peak RSS of {REPEATS} runs |")
    print("|---|---:|---:|")
    print(f"| anetrain SFT, the two chosen sequences | {sft_s:.2f} | {gb(sft_rss)} |")
    print(f"| anetrain DPO | {dpo_s:.2f} | {gb(dpo_rss)} (largest {dpo_rss[-1] / sft_rss[-1]:.2f}x SFT's) |")
    print(f"| anetrain DPO --precompute-ref | {pre_s:.2f} | {gb(pre_rss)} |")
    print(f"| TRL DPOTrainer + PEFT (PyTorch fp32), gradient_checkpointing=False | {trl_s:.2f} | |")
    print(f"| TRL DPOTrainer + PEFT (PyTorch fp32), its default gradient_checkpointing=True | {trl_gc:.2f} | |")
    print(f"time ratio TRL / anetrain (DPO, neither recomputing): {trl_s / dpo_s:.2f}")


if __name__ == "__main__":
    main()
