#!/usr/bin/env python3
"""Times the same training step as `anetrain bench` in PyTorch/transformers
(forward, backward, AdamW; fp32; eager attention) and prints one JSON line.

Usage: python scripts/bench_pytorch.py --model stories110m [--seq 256]
       [--batch 1] [--steps 5] [--warmup 1] [--threads 2] [--fused]
"""
import argparse
import json
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

PRESETS = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True, max_position_embeddings=40960)),
    "stories15m": ("llama", dict(hidden_size=288, intermediate_size=768, num_hidden_layers=6,
                                 num_attention_heads=6, num_key_value_heads=6, vocab_size=32000,
                                 tie_word_embeddings=True, max_position_embeddings=256)),
    "stories42m": ("llama", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                 num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                                 tie_word_embeddings=True, max_position_embeddings=1024)),
    "stories110m": ("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                  num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                                  tie_word_embeddings=True, max_position_embeddings=1024)),
    "tiny": ("qwen3", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                           rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           max_position_embeddings=512)),
}


def cpu_steal():
    """(steal, total) jiffies over all CPUs from /proc/stat, or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return fields[7], sum(fields[:8])
    except (OSError, ValueError, IndexError):
        return None


def matmul_reference(cfg, tokens):
    """Best GFLOP/s of torch.matmul (MKL on x86 builds) on the products
    `anetrain bench` times for its `matmul_gflops`: the FFN projection, its
    weight gradient and the LM head at `tokens` columns, each timed twice
    after a warm-up call, best time counting."""
    d, h, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    x = torch.rand(d, tokens)
    best = 0.0

    def time_it(flops, f):
        nonlocal best
        f()
        for _ in range(2):
            t = time.perf_counter()
            f()
            best = max(best, flops / (time.perf_counter() - t) / 1e9)

    w = torch.rand(h, d)
    y = torch.empty(h, tokens)
    dw = torch.empty(h, d)
    time_it(2.0 * h * d * tokens, lambda: torch.matmul(w, x, out=y))
    time_it(2.0 * h * d * tokens, lambda: torch.matmul(y, x.t(), out=dw))
    del w, dw
    head = torch.rand(v, d)
    lt = torch.empty(v, tokens)
    time_it(2.0 * v * d * tokens, lambda: torch.matmul(head, x, out=lt))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories110m", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fused", action="store_true", help="torch.optim.AdamW(fused=True)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kind, kw = PRESETS[a.model]
    cfg = (Qwen3Config if kind == "qwen3" else LlamaConfig)(attn_implementation="eager", **kw)
    model = (Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM)(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=a.fused)
    steps, phases = [], {"forward": [], "backward": [], "optimizer": []}
    timed_from = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            timed_from = cpu_steal()
        x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= a.warmup:
            steps.append(t3 - t0)
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["optimizer"].append(t3 - t2)
    med = lambda v: sorted(v)[len(v) // 2]
    end = cpu_steal()
    # Read before the reference products allocate their own tensors.
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with torch.no_grad():
        matmul = matmul_reference(cfg, a.seq * a.batch)
    steal = None
    if timed_from and end and end[1] > timed_from[1]:
        steal = (end[0] - timed_from[0]) / (end[1] - timed_from[1])
    print(json.dumps({
        "model": a.model, "engine": "pytorch " + torch.__version__ + (" fused-adamw" if a.fused else ""),
        "seq": a.seq, "batch": a.batch, "threads": a.threads,
        "median_step_s": med(steps), "min_step_s": min(steps),
        "tokens_per_s": a.seq * a.batch / med(steps),
        "peak_rss_mb": peak_rss_mb,
        "host_steal_fraction": steal,
        "matmul_gflops": matmul,
        "phases_median_s": {k: med(v) for k, v in phases.items()},
    }))


if __name__ == "__main__":
    main()
