#!/usr/bin/env python3
"""Builds the LoRA fixtures for anetrain's parity tests with `peft` and
PyTorch, on the small models that scripts/make_fixtures.py wrote (run that
first). For each of qwen3, llama, mistral, granite, qwen2, llama3 and yarn it writes under
<fixtures>/<kind>/lora/:

  adapter/              the starting adapter (peft save_pretrained); B is
                        random instead of zero so every gradient is non-zero
  logits.npy            float32 [batch, n, vocab] of the adapted model
  grads.safetensors     d(mean cross-entropy)/d(adapter), PEFT's saved names
  adamw.safetensors     adapters after one torch.optim.AdamW step
  fixture.json          loss, AdamW hyper-parameters, versions

Usage: python scripts/make_lora_fixtures.py [FIXTURES_DIR [KIND ...]]
"""
import json
import os
import sys

import numpy as np
import peft
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TARGETS = {
    # every projection, rank 4
    "qwen3": dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # a subset, rank 3, an alpha that does not divide evenly
    "llama": dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    # the attention's projections (mlx-lm's usual), rsLoRA's scale
    "mistral": dict(r=4, lora_alpha=6, use_rslora=True,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    # every projection, rank 2
    "granite": dict(r=2, lora_alpha=4, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # the biased projections and the MLP's, rank 4 (the biases stay frozen)
    "qwen2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"]),
    # mlx-lm's and PEFT's usual pair
    "llama3": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "yarn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"]),
    # q and k across the NoPE layer: their gradients pass no rotation there.
    # On the last two of four layers only (PEFT's layers_to_transform,
    # mlx-lm's num_layers): the backward stops above the first two.
    "smollm3": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                    layers_to_transform=[2, 3]),
    "ministral": dict(r=2, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]),
    "gemma3": dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # Phi-3's fused modules: one A shared by q, k and v (by gate and up).
    "phi3": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    # The multimodal Gemma 3's text model only, named by a pattern (a list
    # would adapt the vision tower's q_proj too).
    "gemma3mm": dict(r=4, lora_alpha=8, target_modules=(
        r"model\.language_model\.layers\.\d+\.(self_attn\.(q_proj|v_proj|o_proj)|mlp\.up_proj)")),
    # Gemma 2: the attention's projections and the MLP's gate, through the
    # soft-capped scores.
    "gemma2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]),
    # OLMo 2: q and k through their whole-projection norms, and the MLP.
    "olmo2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj", "down_proj"]),
}
KINDS = list(TARGETS)


def saved_name(n):
    return n.replace(".default.weight", ".weight")


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "testdata/fixtures"
    wanted = sys.argv[2:] or KINDS
    for i, kind in enumerate(KINDS):
        if kind not in wanted:
            continue
        torch.manual_seed(4321 + i)
        base = AutoModelForCausalLM.from_pretrained(
            os.path.join(root, kind, "model"), attn_implementation="eager").float()
        model = get_peft_model(base, LoraConfig(lora_dropout=0.0, **TARGETS[kind]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn_like(p))
        out = os.path.join(root, kind, "lora")
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(os.path.join(out, "adapter"))
        os.remove(os.path.join(out, "adapter", "README.md"))  # a model-card template

        tokens = torch.from_numpy(np.load(os.path.join(root, kind, "tokens.npy")))
        vocab = base.config.get_text_config().vocab_size
        model.train()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        np.save(os.path.join(out, "logits.npy"), logits.detach().numpy().astype(np.float32))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert all("lora_" in n for n, _ in trainable)
        save_file({saved_name(n): p.grad.detach().clone().contiguous() for n, p in trainable},
                  os.path.join(out, "grads.safetensors"))
        opt = torch.optim.AdamW([p for _, p in trainable], lr=ADAMW["lr"], betas=ADAMW["betas"],
                                eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
        opt.step()
        save_file({saved_name(n): p.detach().clone().contiguous() for n, p in trainable},
                  os.path.join(out, "adamw.safetensors"))
        with open(os.path.join(out, "fixture.json"), "w") as f:
            json.dump({
                "kind": kind, "loss": loss.item(), "lr": ADAMW["lr"],
                "beta1": ADAMW["betas"][0], "beta2": ADAMW["betas"][1], "eps": ADAMW["eps"],
                "weight_decay": ADAMW["weight_decay"], "torch": torch.__version__,
                "peft": peft.__version__,
            }, f, indent=1)
        print(f"{kind}: lora loss {loss.item():.6f} -> {out}")


if __name__ == "__main__":
    main()
