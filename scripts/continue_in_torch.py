#!/usr/bin/env python3
"""Continues an anetrain run in PyTorch with DistributedDataParallel, from
exactly where it stopped: the weights, AdamW's moments and step count, the
learning-rate schedule, gradient clipping, the global batch and the data
position (the same windows or records in the same order), so the steps it
takes are the steps `anetrain train --resume` would take.

    torchrun --nproc_per_node P scripts/continue_in_torch.py RUN_DIR --steps N --out DIR

* RUN_DIR is an anetrain run directory (docs/checkpoint.md); the run's
  global batch (--batch x --accum sequences per optimizer step) is split
  evenly over the P processes (refused when it does not divide), so any P
  takes the same steps. gloo on CPUs, NCCL on GPUs (--device).
* It takes N more optimizer steps. The schedule is anetrain's, a function
  of the total: the continued run's total is the run's step + N, as for
  `anetrain train --resume --steps <step + N>`.
* Rank 0 prints one JSON line per step, {"step": k, "loss": L, "lr": lr},
  k continuing the run's numbering, L the mean over the whole global batch.
* DIR becomes a run directory in anetrain's checkpoint format:
  `anetrain train --resume --out DIR --steps M <the run's flags>` continues
  it. Full fine-tuning and LoRA runs (PEFT adapters; LoRA dropout 0) hand
  off; runs on the built-in corpus or on a randomly initialised preset are
  refused (PyTorch cannot rebuild them), and so are preference runs
  (DPO/ORPO) and runs on a quantized base, each in one line.

Numerics: PyTorch in float32 on the CPU computes the same maths in another
order; losses agree with anetrain's CPU engine to about 1e-6 relative.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def fail(msg):
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------- sampling
class Rng:
    """anetrain's SplitMix64 (crates/anetrain/src/util/rng.rs), bit for bit."""

    def __init__(self, state):
        self.state = state & MASK64

    @staticmethod
    def seeded(seed):
        return Rng(seed ^ GOLDEN)

    def next_u64(self):
        self.state = (self.state + GOLDEN) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next_u64() >> 11) / float(1 << 53)

    def below(self, n):
        return int(self.uniform() * n) % max(n, 1)


def shuffled_index(n, seed, cursor):
    """records::shuffled_index: record of draw `cursor`, a fresh
    Fisher-Yates order per epoch seeded by (seed, epoch)."""
    epoch, k = divmod(cursor, n)
    rng = Rng.seeded(seed ^ ((epoch * GOLDEN) & MASK64) ^ 0x5EEDDA7A)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order[k]


# -------------------------------------------------------------------- data
def is_text(path):
    return os.path.splitext(path)[1] in (".txt", ".text", ".md")


def is_records(path):
    return os.path.isdir(path) or path.endswith(".jsonl")


class Stream:
    """A token stream cut into windows of seq + 1 (train/source.rs: load_corpus,
    next_window)."""

    def __init__(self, s, run_dir):
        path = s["data"]
        if is_text(path):
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(os.path.join(run_dir, "tokenizer.json"))
            with open(path, encoding="utf-8") as f:
                ids = tok.encode(f.read(), add_special_tokens=False).ids
            self.tokens = np.asarray(ids, dtype=np.int64)
        else:
            dtype = {"U16": "<u2", "U32": "<u4"}[s["token_dtype"]]
            self.tokens = np.memmap(path, dtype=dtype, mode="r")
        n, seq = len(self.tokens), s["seq"]
        n_val = max(int(n * s["val_frac"]), seq + 1) if s["val_frac"] > 0 else 0
        self.train_end = n - n_val
        self.s = s

    def draw(self, rng, cursor):
        seq = self.s["seq"]
        if self.s["sample"] == "Random":
            start = rng.below(self.train_end - seq)
        else:
            n_windows = (self.train_end - 1) // seq
            start = (cursor % n_windows) * seq
            cursor += 1
        return [int(t) for t in self.tokens[start:start + seq + 1]], 0, cursor


class Records:
    """JSONL records (data/records.rs), tokenized by transformers with the run's
    tokenizer and chat template, fitted to seq + 1, drawn per epoch."""

    def __init__(self, s, run_dir):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(run_dir)
        path, self.s = s["data"], s
        keys = s.get("keys") or {"prompt": "prompt", "completion": "completion"}
        self.pk, self.ck = keys["prompt"], keys["completion"]
        train_file = os.path.join(path, "train.jsonl") if os.path.isdir(path) else path
        valid_file = os.path.join(path, "valid.jsonl") if os.path.isdir(path) else None
        train = self.fit(self.read(train_file))
        if not (valid_file and os.path.isfile(valid_file)) and s["val_frac"] > 0 and len(train) > 1:
            n_val = min(math.ceil(len(train) * s["val_frac"]), len(train) - 1)
            train = train[:len(train) - n_val]
        self.train = train

    def read(self, path):
        recs = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    recs.append(json.loads(line))
        first = recs[0]
        fmt = "chat" if "messages" in first else (
            "completion" if self.pk in first and self.ck in first else "text")
        return [self.tokenize(r, fmt) for r in recs]

    def tokenize(self, r, fmt):
        tok, mask = self.tok, self.s.get("mask_prompt", False)
        eos = tok.eos_token_id

        def with_eos(ids):
            return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids

        if fmt == "text":
            return with_eos(tok.encode(r["text"])), 0
        if fmt == "completion" and not tok.chat_template:
            ids = with_eos(tok.encode(r[self.pk] + r[self.ck]))
            return ids, len(tok.encode(r[self.pk])) if mask else 0
        if fmt == "completion":
            msgs = [{"role": "user", "content": r[self.pk]}, {"role": "assistant", "content": r[self.ck]}]
        else:
            msgs = r["messages"]
        tools = r.get("tools")
        ids = tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=False)
        offset = 0
        if mask:
            offset = len(tok.apply_chat_template(msgs[:-1], tools=tools, tokenize=True, return_dict=False,
                                                 add_generation_prompt=True))
        return list(ids), offset

    def fit(self, examples):
        out, seq = [], self.s["seq"]
        for ids, offset in examples:
            ids = ids[:seq + 1]
            if len(ids) - max(offset, 1) > 0:
                out.append((ids, offset))
        return out

    def draw(self, rng, cursor):
        ids, offset = self.train[shuffled_index(len(self.train), self.s["seed"], cursor)]
        return ids, offset, cursor + 1


# ---------------------------------------------------------------- schedule
def lr_at(step, total, warmup, peak, min_frac):
    """optim::lr_at: linear warmup, cosine decay to min_frac of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1) if total > warmup else 1
    progress = min((step - warmup) / span, 1.0)
    floor = peak * min_frac
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------- checkpoint
def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_run(run_dir):
    state_path = os.path.join(run_dir, "trainer", "state.json")
    if not os.path.isfile(state_path):
        fail(f"'{run_dir}' holds no anetrain checkpoint (trainer/state.json)")
    with open(state_path) as f:
        state = json.load(f)
    if state.get("format") != 1:
        fail(f"'{state_path}' has format {state.get('format')}; this script reads format 1")
    for kind in ("model", "optim"):
        p = os.path.join(run_dir, "trainer", state[f"{kind}_file"])
        if sha256(p) != state[f"{kind}_hash"]:
            fail(f"'{p}' does not match the checksum in state.json")
    return state


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps to take")
    ap.add_argument("--out", required=True, help="new run directory (anetrain's format)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    state = read_run(a.run_dir)
    s, adamw = state["settings"], state["adamw"]
    if a.steps < 1:
        fail("--steps must be at least 1")
    if os.path.exists(a.out):
        fail(f"--out '{a.out}' already exists; choose a new directory")
    if s.get("data") is None:
        fail("the run trained on the built-in corpus, which PyTorch cannot rebuild; train with --data to hand off")
    if s.get("preference"):
        fail("the run trains on preference pairs (--objective dpo or orpo); the hand-off continues "
             "SFT runs only: continue it with anetrain train --resume")
    base_config = os.path.join(s["model"], "config.json")
    quantized_base = os.path.isfile(base_config) and "quantization" in json.load(open(base_config))
    if s.get("quantize_base") or quantized_base:
        fail("the run's base is quantized (MLX 4-bit, or --quantize-base): PyTorch would continue on "
             "another base; hand off runs on f32, f16 or bf16 bases")
    lora = s.get("lora")
    if lora and lora.get("dropout", 0) > 0:
        fail("LoRA dropout masks come from anetrain's generator; hand off runs with --lora-dropout 0")
    if lora and not os.path.isdir(s["model"]):
        fail(f"the LoRA base '{s['model']}' is a randomly initialised preset, which PyTorch cannot rebuild")
    global_batch = s["batch"] * s["accum"]
    if global_batch % world:
        fail(f"the run's global batch ({s['batch']} x --accum {s['accum']} = {global_batch} sequences) "
             f"does not split evenly over {world} processes; use a divisor of {global_batch}")
    per_rank = global_batch // world

    device = torch.device(a.device, int(os.environ.get("LOCAL_RANK", "0")) if a.device == "cuda" else None)
    if world > 1:
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    if a.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    # The model, in float32.
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    tdir = os.path.join(a.run_dir, "trainer")
    weights = load_file(os.path.join(tdir, state["model_file"]))
    moments = load_file(os.path.join(tdir, state["optim_file"]))
    if lora:
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32,
                                                    attn_implementation="eager")
        model = PeftModel.from_pretrained(base, a.run_dir, is_trainable=True)
        named = {n.replace(".default.", "."): p for n, p in model.named_parameters() if p.requires_grad}
    else:
        model = AutoModelForCausalLM.from_pretrained(a.run_dir, dtype=torch.float32,
                                                     attn_implementation="eager")
        named = dict(model.named_parameters())
    # The trainable tensors by anetrain's names (docs/checkpoint.md), in its order.
    params = []
    for name, t in weights.items():
        if name not in named:
            fail(f"the checkpoint's tensor '{name}' is not a parameter of the PyTorch model")
        with torch.no_grad():
            named[name].copy_(t)
        params.append((name, named[name]))
    trained = {id(p) for _, p in params}
    for n, p in model.named_parameters():
        p.requires_grad_(id(p) in trained)
    model.to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)

    # AdamW: decay on matrices and embeddings (every LoRA factor), never on
    # norm weights; the moments and the bias-correction step as saved.
    decay = [p for n, p in params if lora or p.dim() >= 2]
    no_decay = [p for n, p in params if not (lora or p.dim() >= 2)]
    groups = [{"params": decay, "weight_decay": adamw["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=s["lr"], betas=(adamw["beta1"], adamw["beta2"]),
                            eps=adamw["eps"], foreach=False)
    done = state["step"] - state["skipped"]
    for name, p in params:
        opt.state[p] = {"step": torch.tensor(float(done)),
                        "exp_avg": moments[f"m.{name}"].to(device).clone(),
                        "exp_avg_sq": moments[f"v.{name}"].to(device).clone()}

    data = Records(s, a.run_dir) if is_records(s["data"]) else Stream(s, a.run_dir)
    rng, cursor = Rng(state["rng"]), state["cursor"]
    start, total = state["step"], state["step"] + a.steps
    warmup = s["warmup"] if s.get("warmup") is not None else total // 10
    log = []
    for step in range(start, total):
        lr = lr_at(step, total, warmup, s["lr"], s["min_lr_frac"])
        batch = []
        for _ in range(global_batch):
            ids, offset, cursor = data.draw(rng, cursor)
            batch.append((ids, offset))
        n_targets = sum(len(ids) - max(off, 1) for ids, off in batch)
        mine = batch[rank * per_rank:(rank + 1) * per_rank]
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, (ids, offset) in enumerate(mine):
            x = torch.tensor([ids], device=device)
            first = max(offset, 1) - 1
            logits = model(input_ids=x[:, :-1]).logits[0, first:]
            ce = F.cross_entropy(logits.float(), x[0, 1 + first:], reduction="sum")
            # DDP averages gradients over the processes: scale by their count.
            scaled = ce * (world / n_targets)
            if world > 1 and i < len(mine) - 1:
                with model.no_sync():
                    scaled.backward()
            else:
                scaled.backward()
            loss_sum += ce.detach().double()
        if world > 1:
            dist.all_reduce(loss_sum)
        loss = loss_sum.item() / n_targets
        grads = [p for _, p in params]
        if s["clip"] > 0:
            norm = torch.nn.utils.clip_grad_norm_(grads, s["clip"])
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads]))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(json.dumps({"step": step + 1, "loss": loss, "lr": lr}), flush=True)
        log.append({"step": step + 1, "split": "train", "loss": loss, "lr": lr, "grad_norm": float(norm)})

    if rank == 0:
        write_run(a, state, params, opt, log, rng, cursor, total, save_file, lora)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def write_run(a, state, params, opt, log, rng, cursor, total, save_file, lora):
    """--out in anetrain's checkpoint format: the run's files, the new
    weights and moments under trainer/, state.json last."""
    tmp = a.out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "trainer"))
    for f in os.listdir(a.run_dir):
        src = os.path.join(a.run_dir, f)
        if os.path.isfile(src) and f not in ("model.safetensors", "adapter_model.safetensors"):
            shutil.copy2(src, os.path.join(tmp, f))
    weights = {n: p.detach().float().cpu().contiguous() for n, p in params}
    moments = {}
    for n, p in params:
        st = opt.state[p]
        moments[f"m.{n}"] = st["exp_avg"].float().cpu().contiguous()
        moments[f"v.{n}"] = st["exp_avg_sq"].float().cpu().contiguous()
    step = total
    model_file, optim_file = f"model-{step}.safetensors", f"optim-{step}.safetensors"
    save_file(weights, os.path.join(tmp, "trainer", model_file), metadata={"format": "pt"})
    save_file(moments, os.path.join(tmp, "trainer", optim_file))
    top = "adapter_model.safetensors" if lora else "model.safetensors"
    shutil.copy2(os.path.join(tmp, "trainer", model_file), os.path.join(tmp, top))
    with open(os.path.join(tmp, "metrics.jsonl"), "a") as f:
        for rec in log:
            f.write(json.dumps(rec) + "\n")
    new = dict(state)
    new.update(step=step, rng=rng.state, cursor=cursor, total_steps=total,
               model_file=model_file, model_hash=sha256(os.path.join(tmp, "trainer", model_file)),
               optim_file=optim_file, optim_hash=sha256(os.path.join(tmp, "trainer", optim_file)))
    with open(os.path.join(tmp, "trainer", "state.json"), "w") as f:
        json.dump(new, f, indent=2)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
