#!/usr/bin/env python3
"""Writes a randomly initialised bf16 checkpoint of a Hugging Face config of
a family anetrain reads, the way `transformers` saves one (model.safetensors, bf16,
tensors in name order), for memory and speed measurements of models too
large to keep in the repository (Qwen3-4B is 8 GB):

    python3 scripts/random_bf16_checkpoint.py testdata/configs/qwen3-4b.json /tmp/qwen3-4b

Tensors are written one block at a time, so the script needs little memory
whatever the model's size. Matrices and biases are N(0, 0.02), norm weights 1 (Gemma's: 1 + 1). Needs
numpy. Copies the config to OUT/config.json.
"""
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np


def tensors(cfg):
    d, h, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim", d // heads)
    qk_norm = cfg.get("model_type") in ("qwen3", "gemma3_text")
    gemma = cfg.get("model_type") in ("gemma3_text", "gemma2")
    olmo2 = cfg.get("model_type") == "olmo2"
    out = [("model.embed_tokens.weight", [v, d])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [d]),
            (p + "self_attn.q_proj.weight", [heads * hd, d]),
            (p + "self_attn.k_proj.weight", [kv * hd, d]),
            (p + "self_attn.v_proj.weight", [kv * hd, d]),
            (p + "self_attn.o_proj.weight", [d, heads * hd]),
            (p + "post_attention_layernorm.weight", [d]),
            (p + "mlp.gate_proj.weight", [h, d]),
            (p + "mlp.up_proj.weight", [h, d]),
            (p + "mlp.down_proj.weight", [d, h]),
        ]
        if qk_norm:
            out += [(p + "self_attn.q_norm.weight", [hd]), (p + "self_attn.k_norm.weight", [hd])]
        if gemma:  # norms after each sublayer, and before the MLP by its own name
            out += [(p + "pre_feedforward_layernorm.weight", [d]),
                    (p + "post_feedforward_layernorm.weight", [d])]
        if olmo2:  # norms after each sublayer only; QK-norm over whole projections
            out = [(n, s) for n, s in out if n != p + "input_layernorm.weight"]
            out += [(p + "post_feedforward_layernorm.weight", [d]),
                    (p + "self_attn.q_norm.weight", [heads * hd]),
                    (p + "self_attn.k_norm.weight", [kv * hd])]
        if cfg.get("model_type") == "phi3":  # q, k, v and gate, up stored fused
            fused = {"self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", [(heads + 2 * kv) * hd, d]),
                     "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", [2 * h, d])}
            parts = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")
            out = [(p + fused[n[len(p):]][0], fused[n[len(p):]][1])
                   if n.startswith(p) and n[len(p):] in fused else (n, s) for n, s in out]
            out = [(n, s) for n, s in out if not (n.startswith(p) and n[len(p):] in parts)]
        if cfg.get("model_type") == "qwen2":  # q, k and v biases
            out += [(p + "self_attn.q_proj.bias", [heads * hd]),
                    (p + "self_attn.k_proj.bias", [kv * hd]),
                    (p + "self_attn.v_proj.bias", [kv * hd])]
    out.append(("model.norm.weight", [d]))
    # (Gemma's configs tie the head by default, the others' do not.)
    if not cfg.get("tie_word_embeddings", gemma or cfg.get("model_type") == "smollm3"):
        out.append(("lm_head.weight", [v, d]))
    return sorted(out)


def bf16(x):
    """Round-to-nearest-even f32 -> bf16 bits."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: random_bf16_checkpoint.py CONFIG.json OUT_DIR")
    cfg_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = json.loads(cfg_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(cfg_path, out / "config.json")
    ts = tensors(cfg)
    header, at = {}, 0
    for name, shape in ts:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(0)
    tmp = out / "model.safetensors.part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name, shape in ts:
            n = int(np.prod(shape))
            if len(shape) == 1 and not name.endswith(".bias"):
                f.write(bf16(np.ones(n, np.float32)).tobytes())
                continue
            for start in range(0, n, 1 << 24):
                k = min(1 << 24, n - start)
                f.write(bf16(rng.standard_normal(k, np.float32) * 0.02).tobytes())
    tmp.rename(out / "model.safetensors")
    print(f"wrote {len(ts)} tensors, {at / 1e9:.2f} GB of bf16, to {out}")


if __name__ == "__main__":
    main()
