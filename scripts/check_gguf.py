#!/usr/bin/env python3
"""Checks `anetrain export gguf` against llama.cpp itself.

For a small Qwen3 model with a LoRA adapter (testdata/chat/model plus an
adapter trained here), for a llama2.c checkpoint converted by `anetrain
convert` (testdata/fixtures/llama/llama2c.bin, with a small byte-fallback
tokenizer written here), for small Qwen2, Mistral and Granite models
(testdata/mlx/<family>-source), a small random four-layer SmolLM3 and a
six-layer Gemma 3, a four-layer Gemma 2 with soft-capped scores and
logits, a two-layer OLMo 2 and a Phi-3 with partial rotary and LongRoPE made here
(llama.cpp leaves RoPE out of every fourth SmolLM3 layer, makes every
sixth Gemma 3 layer full and every second Gemma 2 layer), in f16 and q8_0:

* reads the file with the `gguf` package (tensor count, architecture,
  tokenizer model);
* loads it in llama.cpp (`llama-cpp-python`) and compares the logits of
  every position of three token sequences with `anetrain eval
  --logits-out`: max |difference| <= 1e-3 x the logit range for f16,
  <= 3e-2 x the range for q8_0;
* greedy-decodes 32 tokens in both (anetrain by repeated `eval`) and
  requires them identical for f16;
* renders the chat records of testdata/chat/renders.json that use the
  Qwen3 template with llama-cpp-python's formatter from the template
  embedded in the file, against the renders transformers produced (which
  anetrain's own renderer reproduces byte for byte, tests/library/chat.rs).

Needs Python with `gguf`, `llama-cpp-python` and `numpy` from PyPI, and a
release build (cargo build --release). Run by hand:

    python3 scripts/check_gguf.py [LABEL ...]   (every case by default)
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "anetrain")
CHAT_MODEL = os.path.join(ROOT, "testdata", "chat", "model")
CHAT_DATA = os.path.join(ROOT, "testdata", "chat", "data", "chat")
LLAMA2C = os.path.join(ROOT, "testdata", "fixtures", "llama", "llama2c.bin")
FAILURES = []


def run(*args):
    r = subprocess.run([BINARY, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"anetrain {' '.join(args)} failed: {r.stderr}")
    return r.stdout


def byte_fallback_tokenizer(path):
    """A SentencePiece-style BPE tokenizer.json of a few pieces."""
    pieces = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "ab", "\u2581ab", "<0x0A>"]
    special = lambda i, c: {"id": i, "content": c, "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False, "special": True}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {p: i for i, p in enumerate(pieces)},
                  "merges": ["a b", "\u2581 ab"]},
    }
    with open(path, "w") as f:
        json.dump(tok, f)


def save_with_chat_tokenizer(model, path):
    """Saves `model` at `path` with the chat model's tokenizer beside it
    (same vocabulary size); returns `path`."""
    import shutil

    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(CHAT_MODEL, f), path)
    return path


def smollm3_source(path):
    """A small random SmolLM3 of four layers (the fourth without RoPE),
    bf16, with the chat model's tokenizer (same vocabulary size)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(
        vocab_size=360, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
        tie_word_embeddings=True)).to(torch.bfloat16)
    return save_with_chat_tokenizer(model, path)


def gemma3_source(path):
    """A small random Gemma 3 of six layers (five windowed of 8 positions,
    then a full one; query_pre_attn_scalar = head_dim, as llama.cpp
    assumes), bf16, norms away from their resting 0, with the chat model's
    tokenizer."""
    import transformers as tf

    return gemma_source(path, lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(num_hidden_layers=6, **GEMMA)))


def gemma2_source(path):
    """A small random Gemma 2 of four layers (windowed of 8 positions and
    full in turn), soft caps small enough that tanh bends the scores and
    the logits, otherwise as gemma3_source."""
    import transformers as tf

    return gemma_source(path, lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
        num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=4.0, **GEMMA)))


# The small Gemma models' shared shape (query_pre_attn_scalar = head_dim,
# as llama.cpp assumes).
GEMMA = dict(vocab_size=360, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.1, tie_word_embeddings=True)


def gemma_source(path, make):
    """The model `make` builds (seeded), norms away from their resting 0,
    bf16, saved with the chat model's tokenizer."""
    import torch

    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.2 * torch.randn_like(p))
    return save_with_chat_tokenizer(model.to(torch.bfloat16), path)


def olmo2_source(path):
    """A small random OLMo 2 (norms after each sublayer only, QK-norm over
    the whole projections), bf16, norms away from 1, with the chat model's
    tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Olmo2ForCausalLM(tf.Olmo2Config(
        vocab_size=360, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return save_with_chat_tokenizer(model.to(torch.bfloat16), path)


def phi3_source(path):
    """A small random Phi-3 (fused qkv_proj and gate_up_proj, RoPE on 12
    of 16 dimensions a head, LongRoPE with an original context of 512 —
    llama.cpp's context here is within it, so both take the short factors
    — and a head tied to the embedding, as Phi-4-mini's), bf16, with the
    chat model's tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(tf.Phi3Config(
        vocab_size=360, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        original_max_position_embeddings=512, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.4, 3.0, 4.2],
                      "long_factor": [1.5, 2.0, 4.0, 6.0, 9.0, 12.0]},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
        tie_word_embeddings=True)).to(torch.bfloat16)
    return save_with_chat_tokenizer(model, path)


def anetrain_logits(model, adapter, tokens, tmp):
    t = os.path.join(tmp, "t.npy")
    out = os.path.join(tmp, "l.npy")
    np.save(t, np.array([tokens], dtype=np.int64))
    args = ["eval", "--backend", "cpu", "--model", model, "--tokens", t, "--logits-out", out]
    if adapter:
        args += ["--adapter", adapter]
    run(*args)
    return np.load(out).reshape(len(tokens) - 1, -1)


def check(label, model, adapter, gguf_path, ty, prompts, tmp):
    import gguf
    from llama_cpp import Llama

    reader = gguf.GGUFReader(gguf_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tok_model = bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode()
    print(f"{label} {ty}: gguf reads {len(reader.tensors)} tensors, {arch}, tokenizer {tok_model}")
    llm = Llama(model_path=gguf_path, n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    worst = 0.0
    for p in prompts:
        ours = anetrain_logits(model, adapter, p + [p[0]], tmp)
        llm.reset()
        llm.eval(p)
        theirs = np.array(llm.scores[: len(p)], dtype=np.float64)
        rng = ours.max() - ours.min()
        diff = np.abs(theirs - ours).max() / rng
        worst = max(worst, diff)
    bound = 1e-3 if ty == "f16" else 3e-2
    print(f"  logits: max |llama.cpp - anetrain| / range = {worst:.2e} (bound {bound:.0e})")
    if worst > bound:
        FAILURES.append(f"{label} {ty}: logits {worst:.2e} > {bound:.0e}")
    if ty == "f16":
        seq = list(prompts[0])
        for _ in range(32):
            seq.append(int(anetrain_logits(model, adapter, seq + [seq[0]], tmp)[-1].argmax()))
        llm.reset()
        theirs = list(prompts[0])
        llm.eval(theirs)
        for _ in range(32):
            nxt = int(np.argmax(llm.scores[len(theirs) - 1]))
            theirs.append(nxt)
            llm.eval([nxt])
        same = seq == theirs
        print(f"  greedy 32 tokens identical: {same}")
        if not same:
            FAILURES.append(f"{label}: greedy differs: {seq} vs {theirs}")
    return reader


def main():
    for mod in ("gguf", "llama_cpp"):
        try:
            __import__(mod)
        except ImportError:
            sys.exit(f"needs {mod}: pip install gguf llama-cpp-python numpy")
    if not os.path.isfile(BINARY):
        sys.exit(f"needs {BINARY}: cargo build --release")
    with tempfile.TemporaryDirectory() as tmp:
        adapter = os.path.join(tmp, "adapter")
        run("train", "--model", CHAT_MODEL, "--data", CHAT_DATA, "--lora-rank", "8",
            "--mask-prompt", "--steps", "40", "--batch", "8", "--seq", "128", "--lr", "1e-2",
            "--eval-every", "0", "--backend", "cpu", "--out", adapter)
        stories = os.path.join(tmp, "stories")
        run("convert", LLAMA2C, "--out", stories)
        byte_fallback_tokenizer(os.path.join(stories, "tokenizer.json"))
        with open(os.path.join(stories, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)
        cases = [
            ("qwen3 + LoRA", CHAT_MODEL, adapter, [[1, 20, 30, 40, 50], [5, 6, 7], [100, 3, 200, 17, 9, 2]]),
            ("llama2.c stories", stories, None, [[1, 4, 5, 6], [1, 50, 60, 70, 80, 90], [2, 3]]),
        ]
        # The other families: small random bf16 models (make_mlx_fixtures.py's
        # sources, with the chat model's tokenizer).
        for family in ("qwen2", "mistral", "granite"):
            source = os.path.join(ROOT, "testdata", "mlx", f"{family}-source")
            cases.append((family, source, None, [[1, 20, 30, 40, 50], [5, 6, 7], [100, 3, 200, 17]]))
        smollm3 = smollm3_source(os.path.join(tmp, "smollm3"))
        cases.append(("smollm3", smollm3, None, [[1, 20, 30, 40, 50, 60, 70], [5, 6, 7], [100, 3, 200, 17]]))
        gemma3 = gemma3_source(os.path.join(tmp, "gemma3"))
        # Longer than the window: the windowed layers' masks bite.
        cases.append(("gemma3", gemma3, None, [[1, 20, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13], [5, 6, 7]]))
        gemma2 = gemma2_source(os.path.join(tmp, "gemma2"))
        cases.append(("gemma2", gemma2, None, [[1, 20, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13], [5, 6, 7]]))
        olmo2 = olmo2_source(os.path.join(tmp, "olmo2"))
        cases.append(("olmo2", olmo2, None, [[1, 20, 30, 40, 50, 60, 70], [5, 6, 7], [100, 3, 200, 17]]))
        # (Not named "phi3": llama.cpp's vocabulary loader looks up Phi's
        # own special tokens in a model whose name says phi, and the chat
        # tokenizer has none.)
        phi3 = phi3_source(os.path.join(tmp, "small-p3"))
        cases.append(("phi3", phi3, None, [[1, 20, 30, 40, 50, 60, 70], [5, 6, 7], [100, 3, 200, 17]]))
        only = sys.argv[1:]
        for label, model, adapter_dir, prompts in cases:
            if only and label.split()[0] not in only:
                continue
            for ty in ("f16", "q8_0"):
                out = os.path.join(tmp, f"{label.split()[0]}-{ty}.gguf")
                args = ["export", "gguf", "--model", model, "--out", out, "--type", ty]
                if adapter_dir:
                    args += ["--adapter", adapter_dir]
                run(*args)
                check(label, model, adapter_dir, out, ty, prompts, tmp)

        if only and "qwen3" not in only:
            renders_checked = False
        else:
            renders_checked = check_renders(tmp)
    if FAILURES:
        sys.exit("FAILED: " + "; ".join(FAILURES))
    print("all checks passed" + ("" if renders_checked else " (chat renders not checked)"))


def check_renders(tmp):
    """The Qwen3 chat template embedded in the file, rendered by
    llama-cpp-python, against transformers' renders."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    reader = __import__("gguf").GGUFReader(os.path.join(tmp, "qwen3-f16.gguf"))
    template = bytes(reader.fields["tokenizer.chat_template"].parts[-1]).decode()
    renders = json.load(open(os.path.join(ROOT, "testdata", "chat", "renders.json")))
    n = 0
    for r in renders:
        if r["template"] != "qwen3" or r["tools"] or r["extra"]:
            continue
        fmt = Jinja2ChatFormatter(template, eos_token=r["special"].get("eos_token", ""),
                                  bos_token=r["special"].get("bos_token", ""),
                                  add_generation_prompt=r["add_generation_prompt"])
        got = fmt(messages=r["messages"]).prompt
        assert got == r["expected"], (got, r["expected"])
        n += 1
    print(f"chat template from the file: {n} renders equal transformers' (and ours)")
    return True


if __name__ == "__main__":
    main()
