#!/usr/bin/env python3
"""Builds the small Hugging Face `transformers` fixtures that anetrain's
parity tests read (committed under testdata/fixtures/, so
`cargo test` needs no Python).

For each model — Qwen3 (GQA ratio 2, QK-norm, tied embeddings, head_dim !=
hidden/heads), Llama (MHA, untied), Mistral (GQA, an attention window of 5
positions, shorter than the fixture's sequence), Granite (every multiplier away
from 1), Qwen2 (biases on q, k and v) and Llama 3 (Llama 3.1's RoPE
scaling, every branch of it in use), Qwen3 with YaRN (its ramp
between the correction dimensions inside the head, attention factor from
mscale), SmolLM3 (four layers, the fourth without RoPE, as
llama.cpp's smollm3 also places them), Ministral (a window of 5 on its
first layer, none on its second), Gemma 3 (windowed layers of 4
positions with their own RoPE base around a full one, a query scalar apart
from head_dim) and Phi-3 (fused qkv_proj and gate_up_proj, RoPE on 12 of
16 dimensions a head, LongRoPE with an original context of 8 positions —
the fixture's 12 use the long factors, greedy decoding crosses from the
short to the long — and a window of 5) and Gemma 3's multimodal
checkpoint (Gemma3ForConditionalGeneration, as the 4B and larger are
published: the text model under `language_model.`, linear RoPE scaling on
its full layers, a small vision tower the text never uses) and Gemma 2
(windowed and full layers in turn, Gemma2Config's default, a window of 4;
soft caps small enough that tanh bends the fixture's scores and logits)
and OLMo 2 (norms after each sublayer only, QK-norm over the whole q and
k projections, grouped-query attention) — it writes:

  model/            config.json + model.safetensors (save_pretrained, f32)
  tokens.npy        int64 [batch, n+1]
  logits.npy        float32 [batch, n, vocab]   (model(tokens[:, :-1]).logits)
  grads.safetensors d(mean cross-entropy)/d(param), HF names
  adamw.safetensors parameters after one torch.optim.AdamW step
  greedy.npy        int64: greedy continuation of tokens[0, :prompt_len]
  fixture.json      loss, AdamW hyper-parameters, prompt length

Norm weights are moved away from 1 so norm-backward mistakes show.

Usage: python scripts/make_fixtures.py [OUT_DIR [KIND ...]]  (every kind by default)
"""
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import (
    GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    SmolLM3Config, SmolLM3ForCausalLM, MinistralConfig, MinistralForCausalLM,
    Gemma3ForCausalLM, Gemma3TextConfig, Phi3Config, Phi3ForCausalLM, Gemma3Config,
    Gemma3ForConditionalGeneration, Gemma2Config, Gemma2ForCausalLM, Olmo2Config,
    Olmo2ForCausalLM,
)

KINDS = ["qwen3", "llama", "mistral", "granite", "qwen2", "llama3", "yarn", "smollm3", "ministral",
         "gemma3", "phi3", "gemma3mm", "gemma2", "olmo2"]

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
PROMPT_LEN = 5
NEW_TOKENS = 8


def build(kind):
    if kind == "qwen3":
        cfg = Qwen3Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24,
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=64, attn_implementation="eager",
        )
        return Qwen3ForCausalLM(cfg)
    if kind == "mistral":
        cfg = MistralConfig(
            vocab_size=112, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=8,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            sliding_window=5, max_position_embeddings=64, attn_implementation="eager",
        )
        return MistralForCausalLM(cfg)
    if kind == "granite":
        cfg = GraniteConfig(
            vocab_size=100, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=64,
            embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
            logits_scaling=2.5, attn_implementation="eager",
        )
        return GraniteForCausalLM(cfg)
    if kind == "yarn":
        cfg = Qwen3Config(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 2048},
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=8192,
            attn_implementation="eager",
        )
        return Qwen3ForCausalLM(cfg)
    if kind == "llama3":
        cfg = LlamaConfig(
            vocab_size=104, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
            attn_implementation="eager",
        )
        return LlamaForCausalLM(cfg)
    if kind == "gemma3":
        cfg = Gemma3TextConfig(
            vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=64,
            pad_token_id=None, bos_token_id=2, eos_token_id=1, attn_implementation="eager",
        )
        return Gemma3ForCausalLM(cfg)
    if kind == "gemma2":
        cfg = Gemma2Config(
            vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=4, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=64,
            pad_token_id=None, bos_token_id=2, eos_token_id=1, attn_implementation="eager",
        )
        return Gemma2ForCausalLM(cfg)
    if kind == "olmo2":
        cfg = Olmo2Config(
            vocab_size=104, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 5e5},
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=None, eos_token_id=2, attn_implementation="eager",
        )
        return Olmo2ForCausalLM(cfg)
    if kind == "gemma3mm":
        text = dict(
            vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            rms_norm_eps=1e-6, max_position_embeddings=64,
        )
        vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)
        cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                           boi_token_index=90, eoi_token_index=91, image_token_index=92,
                           pad_token_id=0, bos_token_id=2, eos_token_id=1,
                           attn_implementation="eager")
        return Gemma3ForConditionalGeneration(cfg)
    if kind == "phi3":
        cfg = Phi3Config(
            vocab_size=100, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=64, original_max_position_embeddings=8,
            partial_rotary_factor=0.75, sliding_window=5,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.1],
                          "long_factor": [1.1, 2.0, 3.5, 5.0, 7.5, 9.0]},
            pad_token_id=0, bos_token_id=2, eos_token_id=1, attn_implementation="eager",
        )
        return Phi3ForCausalLM(cfg)
    if kind == "ministral":
        cfg = MinistralConfig(
            vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=1e6,
            rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
            attn_implementation="eager",
        )
        return MinistralForCausalLM(cfg)
    if kind == "smollm3":
        cfg = SmolLM3Config(
            vocab_size=104, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=2e6,
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
        )
        return SmolLM3ForCausalLM(cfg)
    if kind == "qwen2":
        cfg = Qwen2Config(
            vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=64,
            attn_implementation="eager",
        )
        return Qwen2ForCausalLM(cfg)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=12,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=64, attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def export_llama2c(model, path):
    """Writes a Llama model in llama2.c's legacy .bin format (run.c), with
    q/k rows permuted back to llama2.c's interleaved RoPE pairs, as
    llama2.c's export.py does for Hugging Face models."""
    import struct
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}

    def unpermute(w, heads):
        # HF row h*hd + t*hd/2 + i  <-  llama2.c row h*hd + 2i + t
        return w.view(heads, 2, hd // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    shared = c.tie_word_embeddings
    layers = range(c.num_hidden_layers)
    L = lambda name: [sd[f"model.layers.{i}.{name}"] for i in layers]
    tensors = [sd["model.embed_tokens.weight"]]
    tensors += L("input_layernorm.weight")
    tensors += [unpermute(w, c.num_attention_heads) for w in L("self_attn.q_proj.weight")]
    tensors += [unpermute(w, c.num_key_value_heads) for w in L("self_attn.k_proj.weight")]
    tensors += L("self_attn.v_proj.weight") + L("self_attn.o_proj.weight")
    tensors += L("post_attention_layernorm.weight")
    tensors += L("mlp.gate_proj.weight") + L("mlp.down_proj.weight") + L("mlp.up_proj.weight")
    tensors += [sd["model.norm.weight"]]
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(c.max_position_embeddings).float(), freqs)
    tensors += [torch.cos(ang), torch.sin(ang)]
    if not shared:
        tensors += [sd["lm_head.weight"]]
    with open(path, "wb") as f:
        vocab = c.vocab_size if shared else -c.vocab_size
        f.write(struct.pack("7i", c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                            c.num_attention_heads, c.num_key_value_heads, vocab,
                            c.max_position_embeddings))
        for t in tensors:
            f.write(t.contiguous().numpy().astype("<f4").tobytes())


def saved_name(kind, name):
    """The checkpoint's key of a parameter (transformers saves a multimodal
    Gemma 3 under the names it was published with)."""
    if kind != "gemma3mm":
        return name
    for module, saved in (("model.language_model.", "language_model.model."),
                          ("model.vision_tower.", "vision_tower."),
                          ("model.multi_modal_projector.", "multi_modal_projector."),
                          ("lm_head.", "language_model.lm_head.")):
        if name.startswith(module):
            return saved + name[len(module):]
    return name


def main():
    out_root = sys.argv[1] if len(sys.argv) > 1 else "testdata/fixtures"
    wanted = sys.argv[2:] or KINDS
    for i, kind in enumerate(KINDS):
        if kind not in wanted:
            continue
        torch.manual_seed(1234 + i)
        model = build(kind).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                elif p.dim() == 1:  # norm weights away from their resting value
                    # (Gemma's norms scale by 1 + w: theirs rests at 0)
                    rest = 0.0 if kind.startswith("gemma") else 1.0
                    p.copy_(rest + 0.3 * torch.randn_like(p))
                else:
                    p.copy_(0.08 * torch.randn_like(p))
        out = os.path.join(out_root, kind)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
        vocab = model.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(99 + i)
        tokens = torch.randint(0, vocab, (2, 13), generator=g)
        np.save(os.path.join(out, "tokens.npy"), tokens.numpy().astype(np.int64))

        model.train()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        np.save(os.path.join(out, "logits.npy"), logits.detach().numpy().astype(np.float32))
        # (A multimodal model's vision tower takes no gradient from text.)
        grads = {saved_name(kind, n): p.grad.detach().clone().contiguous()
                 for n, p in model.named_parameters() if p.grad is not None}
        save_file(grads, os.path.join(out, "grads.safetensors"))

        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": ADAMW["weight_decay"]},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
        )
        opt.step()
        after = {saved_name(kind, n): p.detach().clone().contiguous() for n, p in model.named_parameters()}
        save_file(after, os.path.join(out, "adamw.safetensors"))

        # Greedy continuation from the original weights.
        fresh = type(model).from_pretrained(os.path.join(out, "model"), attn_implementation="eager").float().eval()
        with torch.no_grad():
            prompt = tokens[:1, :PROMPT_LEN]
            gen = fresh.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        np.save(os.path.join(out, "greedy.npy"), gen[0].numpy().astype(np.int64))

        if kind == "llama":
            export_llama2c(fresh, os.path.join(out, "llama2c.bin"))

        with open(os.path.join(out, "fixture.json"), "w") as f:
            json.dump({
                "kind": kind, "loss": loss.item(), "lr": ADAMW["lr"],
                "beta1": ADAMW["betas"][0], "beta2": ADAMW["betas"][1], "eps": ADAMW["eps"],
                "weight_decay": ADAMW["weight_decay"], "prompt_len": PROMPT_LEN,
                "new_tokens": NEW_TOKENS, "torch": torch.__version__,
            }, f, indent=1)
        print(f"{kind}: loss {loss.item():.6f} -> {out}")


if __name__ == "__main__":
    main()
