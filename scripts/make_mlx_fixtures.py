#!/usr/bin/env python3
"""MLX-quantized fixtures: testdata/mlx/.

Quantizes the small Qwen3 model of testdata/chat/model (tied head, f32)
and small random Llama, Qwen2, Mistral, Granite, SmolLM3, Gemma 3 and Phi-3 models made here (bf16:
testdata/mlx/<family>-source) with mlx-lm's `convert` (mlx's CPU backend on
Linux, `pip install "mlx[cpu]" mlx-lm`) in several widths, group sizes and
dtypes, one of them with mlx-lm's mixed 3/6-bit recipe (per-module entries
in config.json), and records what mlx computes from each, so `cargo test`
checks anetrain against it without Python:

  testdata/mlx/<variant>/config.json, model.safetensors(.index.json)
      exactly as `mlx_lm.convert -q` writes them;
  testdata/mlx/<variant>/expected.safetensors
      `mx.dequantize` of two quantized matrices (f32); the logits of
      mlx-lm's own model (its quantized matmuls, in the checkpoint's dtype)
      on TOKENS, and of the same model dequantized and run in f32;
  testdata/mlx/expected.json
      the variants, the tokens and the versions.

Run from the repository root: python3 scripts/make_mlx_fixtures.py [VARIANT ...]
(every variant by default; named ones are remade, with their sources, and
the others kept).
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import dequantize_model, load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "testdata", "chat", "model")
OUT = os.path.join(ROOT, "testdata", "mlx")
TOKENS = [1, 17, 42, 5, 99, 200, 7, 311, 64, 12, 150, 3, 77, 250, 8, 31]
LLAMA = os.path.join(OUT, "llama-source")
# Other families' small random sources (bf16), made here.
QWEN2 = os.path.join(OUT, "qwen2-source")
MISTRAL = os.path.join(OUT, "mistral-source")
GRANITE = os.path.join(OUT, "granite-source")
SMOLLM3 = os.path.join(OUT, "smollm3-source")
GEMMA3 = os.path.join(OUT, "gemma3-source")
PHI3 = os.path.join(OUT, "phi3-source")
# name: (source, bits, group size, dtype, recipe). The Qwen3 source ties
# its head to the embedding; the Llama one (bf16, made here) does not.
VARIANTS = {
    "q4-g32-f32": (SOURCE, 4, 32, "float32", None),
    "q8-g64-f32": (SOURCE, 8, 64, "float32", None),
    "q4-g64-bf16": (SOURCE, 4, 64, "bfloat16", None),
    "q8-g32-f32": (SOURCE, 8, 32, "float32", None),
    "q3-g32-bf16": (SOURCE, 3, 32, "bfloat16", None),
    "q6-g64-bf16": (SOURCE, 6, 64, "bfloat16", None),
    "q2-g32-f16": (SOURCE, 2, 32, "float16", None),
    "mixed36-g32-bf16": (SOURCE, 3, 32, "bfloat16", "mixed_3_6"),
    "llama-q4-g64-bf16": (LLAMA, 4, 64, "bfloat16", None),
    "llama-q8-g32-bf16": (LLAMA, 8, 32, "bfloat16", None),
    "qwen2-q4-g64-bf16": (QWEN2, 4, 64, "bfloat16", None),
    "mistral-q4-g32-bf16": (MISTRAL, 4, 32, "bfloat16", None),
    "granite-q4-g64-bf16": (GRANITE, 4, 64, "bfloat16", None),
    "smollm3-q4-g64-bf16": (SMOLLM3, 4, 64, "bfloat16", None),
    "gemma3-q4-g64-bf16": (GEMMA3, 4, 64, "bfloat16", None),
    "phi3-q4-g64-bf16": (PHI3, 4, 64, "bfloat16", None),
}
SOURCES = [("llama", LLAMA), ("qwen2", QWEN2), ("mistral", MISTRAL), ("granite", GRANITE),
           ("smollm3", SMOLLM3), ("gemma3", GEMMA3), ("phi3", PHI3)]


def make_source(kind, path):
    """A small random model of `kind` (Llama with an untied head; Qwen2
    with q/k/v biases, tied; Mistral with an attention window; Granite with its multipliers), saved in bf16 by transformers
    (the dtype Hub checkpoints are published in)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=360, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    )
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(head_dim=16, tie_word_embeddings=False, **common))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(tie_word_embeddings=True, **common))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.copy_(0.2 * torch.randn_like(p))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(
            # A window longer than TOKENS: mlx-lm's Mistral attends over
            # windows only for config layer_types transformers does not
            # write, so the two agree only where the window does not bite.
            head_dim=16, sliding_window=64, tie_word_embeddings=False, **common))
    elif kind == "smollm3":
        # The second layer without RoPE (SmolLM3 leaves it out of every
        # fourth; two layers keep the bf16 comparison's bound).
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(
            tie_word_embeddings=True, pad_token_id=0, no_rope_layer_interval=2, **common))
    elif kind == "gemma3":
        # A windowed layer (8 positions, shorter than TOKENS, its own RoPE
        # base) then a full one: mlx-lm reads the pattern, transformers
        # the layer types.
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            tie_word_embeddings=True, pad_token_id=0, **common))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.dim() == 1:  # norms away from their resting 0
                    p.copy_(0.2 * torch.randn_like(p))
    elif kind == "phi3":
        # Fused qkv_proj and gate_up_proj, RoPE on 12 of 16 dimensions a
        # head; no LongRoPE (mlx-lm applies its long factors at every
        # length, transformers its short ones up to the original context)
        # and no window (mlx-lm's phi3 has none).
        model = tf.Phi3ForCausalLM(tf.Phi3Config(
            partial_rotary_factor=0.75, tie_word_embeddings=False, pad_token_id=0, **common))
    else:
        model = tf.GraniteForCausalLM(tf.GraniteConfig(
            tie_word_embeddings=True, embedding_multiplier=6.0, residual_multiplier=0.3,
            attention_multiplier=0.1, logits_scaling=3.0, **common))
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    for f in os.listdir(path):
        if f not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(path, f))
    # Published configs carry `rope_theta` beside transformers 5's
    # `rope_parameters`; mlx-lm's Granite needs it.
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    rope = config["rope_parameters"]
    if "full_attention" in rope:  # Gemma's, per layer type
        config["rope_theta"] = rope["full_attention"]["rope_theta"]
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        config["sliding_window_pattern"] = 2
    else:
        config["rope_theta"] = rope["rope_theta"]
    json.dump(config, open(config_path, "w"), indent=2)
    # mlx-lm loads a tokenizer with any model: the Qwen3 model's (same
    # vocabulary size).
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(SOURCE, f), path)
# Matrices whose dequantized values are recorded (the embedding is the
# head too: the model ties them).
CHECKED = ["model.embed_tokens", "model.layers.1.mlp.down_proj", "lm_head"]


def main():
    wanted = sys.argv[1:] or list(VARIANTS)
    unknown = [w for w in wanted if w not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    remade = {VARIANTS[w][0] for w in wanted}
    keep = ["adapter"]  # scripts/make_mlx_adapter_fixture.py's
    keep += [v for v in VARIANTS if v not in wanted]
    keep += [os.path.basename(p) for _, p in SOURCES if p not in remade]
    for d in os.listdir(OUT) if os.path.isdir(OUT) else []:
        if d not in keep and os.path.isdir(os.path.join(OUT, d)):
            shutil.rmtree(os.path.join(OUT, d), ignore_errors=True)
    os.makedirs(OUT, exist_ok=True)
    for kind, path in SOURCES:
        if path in remade:
            make_source(kind, path)
    sources = {}
    for name, (source, bits, group, dtype, recipe) in VARIANTS.items():
        out = os.path.join(OUT, name)
        sources[name] = os.path.relpath(source, os.path.join(ROOT, "testdata"))
        if name not in wanted:
            continue
        cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", source]
        cmd += ["--mlx-path", out, "-q", "--q-bits", str(bits), "--q-group-size", str(group)]
        cmd += ["--dtype", dtype]
        if recipe:
            cmd += ["--quant-predicate", recipe]
        subprocess.run(cmd, check=True, capture_output=True)
        # Weights and config only: the tokenizer is testdata/chat/model's.
        for f in os.listdir(out):
            if f not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
                os.remove(os.path.join(out, f))
        weights = mx.load(os.path.join(out, "model.safetensors"))
        config = json.load(open(os.path.join(out, "config.json")))
        expected = {}
        for module in CHECKED:
            if f"{module}.scales" not in weights:
                continue
            spec = config["quantization"].get(module, config["quantization"])
            w = mx.dequantize(
                weights[f"{module}.weight"],
                weights[f"{module}.scales"],
                weights[f"{module}.biases"],
                group_size=spec["group_size"],
                bits=spec["bits"],
            )
            expected[f"{module}.dequantized"] = w.astype(mx.float32)
        model, _ = load_model(Path(out))
        logits = model(mx.array([TOKENS]))[0]
        expected["logits"] = logits.astype(mx.float32)
        # The same model dequantized (mx.dequantize, in the checkpoint's
        # dtype) and run in f32: what anetrain computes.
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        expected["logits_f32"] = model(mx.array([TOKENS]))[0].astype(mx.float32)
        mx.save_safetensors(os.path.join(out, "expected.safetensors"), expected)
        print(name, {k: tuple(v.shape) for k, v in expected.items()})
    versions = {p: importlib.metadata.version(p) for p in ("mlx", "mlx-lm")}
    json.dump(
        {"tokens": TOKENS, "variants": list(VARIANTS), "sources": sources, **versions},
        open(os.path.join(OUT, "expected.json"), "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
