#!/usr/bin/env python3
"""Builds the fine-tuning data fixtures under testdata/chat/ with Hugging
Face `transformers` (committed, so `cargo test` needs no Python):

  templates/*.jinja   the chat templates (inputs, not generated: Qwen3-0.6B's
                      and Llama-3.2-3B-Instruct's as published with those
                      models, and the ChatML template of the transformers docs)
  renders.json        apply_chat_template(..., tokenize=False) of each template
                      over conversations with system messages, several turns,
                      empty content, non-ASCII text, reasoning, tools, with and
                      without add_generation_prompt
  model/              a small Qwen3 model whose tokenizer carries Qwen3's chat
                      template (tokenizer.json, tokenizer_config.json)
  data/{chat,completion,text}/{train,valid,test}.jsonl
  losses.json         per data directory and split: the mean cross-entropy over
                      target tokens, with and without prompt masking, and the
                      token count, computed by PyTorch with mlx_lm's rule:
                      chat: tokens = apply_chat_template(messages),
                            offset = len(apply_chat_template(messages[:-1],
                                                             add_generation_prompt=True))
                      completion: the same with [user: prompt, assistant: completion]
                      text: tokens = encode(text) (+ EOS when absent), offset 0
                      loss on tokens[offset:], i.e. targets j with j + 1 >= offset,
                      averaged over all targets of the split.

Usage: python scripts/make_chat_fixtures.py [OUT_DIR]   (default testdata/chat)
"""
import json
import math
import os
import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

OUT = sys.argv[1] if len(sys.argv) > 1 else "testdata/chat"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
NAMES = ["Ada", "Grete", "Jürgen", "Søren", "Zoë", "東京", "Ωmega", "Ramón"]


def conversation(rng, i):
    a, b = rng.randrange(2, 20), rng.randrange(2, 20)
    name = rng.choice(NAMES)
    msgs = []
    if i % 3 == 0:
        msgs.append({"role": "system", "content": f"You are a terse calculator for {name}."})
    turns = 1 + i % 2
    for t in range(turns):
        x, y = a + t, b + 2 * t
        msgs.append({"role": "user", "content": f"What is {x} plus {y}?"})
        msgs.append({"role": "assistant", "content": f"{x} plus {y} is {x + y}."})
    return msgs


def write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def datasets(rng):
    """{format: {split: [records]}}"""
    sizes = {"train": 48, "valid": 8, "test": 8}
    out = {"chat": {}, "completion": {}, "text": {}}
    k = 0
    for split, n in sizes.items():
        chats, comps, texts = [], [], []
        for _ in range(n):
            msgs = conversation(rng, k)
            k += 1
            rec = {"messages": msgs}
            if split == "test" and k % 4 == 0:
                rec["tools"] = [{"type": "function", "function": {
                    "name": "add", "description": "Adds two numbers — exactly.",
                    "parameters": {"type": "object", "properties": {
                        "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
            chats.append(rec)
            user, assistant = msgs[-2]["content"], msgs[-1]["content"]
            comps.append({"prompt": user, "completion": assistant})
            texts.append({"text": f"{user} {assistant}"})
        out["chat"][split], out["completion"][split], out["text"][split] = chats, comps, texts
    return out


def build_tokenizer(corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def hf_tokenizer(tok, template, bos, eos):
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, bos_token=bos,
                                   eos_token=eos, pad_token="<|endoftext|>")


def render_cases():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, in °C.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                             "required": ["city"]}}}]
    convs = [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello. How can I help?"}, {"role": "user", "content": "Tell a joke."},
         {"role": "assistant", "content": "No."}],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
        [{"role": "system", "content": "  Réponds en français.  "}, {"role": "user", "content": "Grüße aus 東京 — ça va? 🙂"},
         {"role": "assistant", "content": "Très bien, merci!\nEt toi?"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}],
        [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5", "reasoning_content": "two plus three"}],
        # A tool call and its result (arguments as a mapping: tojson; the
        # result as a string, which Llama 3's template tests `is iterable`).
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "",
          "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                            "arguments": {"city": "Paris", "unit": "°C", "days": 2}}}]},
         {"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
         {"role": "assistant", "content": "21.5 °C and clear."}],
    ]
    cases = []
    for ci, conv in enumerate(convs):
        for agp in (False, True):
            cases.append(dict(messages=conv, add_generation_prompt=agp, tools=None, extra={}))
    cases.append(dict(messages=convs[1][:2], add_generation_prompt=True, tools=tools, extra={}))
    cases.append(dict(messages=convs[0], add_generation_prompt=True, tools=None, extra={"enable_thinking": False}))
    return cases


def main():
    rng = random.Random(7)
    torch.manual_seed(7)
    data = datasets(rng)
    corpus = []
    for fmt in data.values():
        for recs in fmt.values():
            corpus += [json.dumps(r, ensure_ascii=False) for r in recs]
    corpus += ["What is the weather? Très bien, merci! Grüße 🙂 " * 3]
    tok = build_tokenizer(corpus)
    templates = {name: open(os.path.join(OUT, "templates", f"{name}.jinja"), encoding="utf-8").read()
                 for name in ("qwen3", "llama3", "chatml")}
    specials = {"qwen3": (None, "<|im_end|>"), "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
                "chatml": (None, "<|im_end|>")}

    # Renders, through a tokenizer carrying each template.
    renders = []
    for name, src in templates.items():
        bos, eos = specials[name]
        hf = hf_tokenizer(tok, src, bos, eos)
        for c in render_cases():
            extra = dict(c["extra"])
            if name == "llama3":
                extra["date_string"] = "26 Jul 2024"  # the template reads today's date otherwise
            text = hf.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False,
                                          add_generation_prompt=c["add_generation_prompt"], **extra)
            renders.append(dict(template=name, special=hf.special_tokens_map, messages=c["messages"],
                                tools=c["tools"], add_generation_prompt=c["add_generation_prompt"],
                                extra=extra, expected=text))
    with open(os.path.join(OUT, "renders.json"), "w", encoding="utf-8") as f:
        json.dump(renders, f, ensure_ascii=False, indent=1)

    # The model and its tokenizer (Qwen3's template).
    hf = hf_tokenizer(tok, templates["qwen3"], None, "<|im_end|>")
    mdir = os.path.join(OUT, "model")
    hf.save_pretrained(mdir)
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=1024,
                      initializer_range=0.3, attn_implementation="eager",
                      bos_token_id=None, eos_token_id=hf.eos_token_id)
    model = Qwen3ForCausalLM(cfg).float().eval()
    model.save_pretrained(mdir)

    # Datasets and their losses.
    def tokens_of(fmt, rec):
        if fmt == "text":
            ids = hf.encode(rec["text"])
            if ids[-1] != hf.eos_token_id:
                ids.append(hf.eos_token_id)
            return ids, 0
        msgs = rec["messages"] if fmt == "chat" else [
            {"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
        tools = rec.get("tools")
        ids = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=False)
        prompt = hf.apply_chat_template(msgs[:-1], tools=tools, tokenize=True, return_dict=False,
                                        add_generation_prompt=True)
        assert ids[:len(prompt)] == prompt, "the prompt is not a prefix of the conversation"
        return ids, len(prompt)

    losses = {}
    for fmt, splits in data.items():
        losses[fmt] = {}
        for split, recs in splits.items():
            write_jsonl(os.path.join(OUT, "data", fmt, f"{split}.jsonl"), recs)
            res = {}
            for masked in (False, True):
                total, count, rows = 0.0, 0, []
                for rec in recs:
                    ids, offset = tokens_of(fmt, rec)
                    start = max(offset if masked else 0, 1)
                    with torch.no_grad():
                        logits = model(torch.tensor([ids[:-1]])).logits[0].double()
                    lp = torch.log_softmax(logits, -1)
                    for j in range(start - 1, len(ids) - 1):
                        total -= lp[j, ids[j + 1]].item()
                        count += 1
                    rows.append(dict(tokens=ids, offset=offset))
                res["masked" if masked else "unmasked"] = dict(loss=total / count, tokens=count)
                if split == "test":
                    res["records"] = rows
            losses[fmt][split] = res
    with open(os.path.join(OUT, "losses.json"), "w", encoding="utf-8") as f:
        json.dump(losses, f, indent=1)
    for fmt in losses:
        t = losses[fmt]["test"]
        print(fmt, "test masked", t["masked"], "unmasked", t["unmasked"])


if __name__ == "__main__":
    main()
