#!/usr/bin/env python3
"""Builds the preference-tuning fixtures under testdata/preference/ with
Hugging Face TRL (committed, so `cargo test` needs no Python):

  data/{chat,strings}/{train,valid}.jsonl
                  two training and two validation pairs each: TRL's
                  conversational layout (prompt/chosen/rejected message lists)
                  and its standard one (strings)
  adapter/        the starting adapter (peft save_pretrained over
                  testdata/chat/model): LoRA r 4, alpha 8, every projection,
                  A from PEFT's initialisation (non-zero), B zero
  runs.json       per run (objective, loss type, data): TRL's logged metrics
                  of 5 steps — DPOTrainer / ORPOTrainer with the PEFT model,
                  CPU, fp32, batch of the 2 training pairs (so every step
                  sees both, whatever the sampler's order), AdamW (betas 0.9,
                  0.999, eps 1e-8, no weight decay), constant learning rate,
                  max_grad_norm 1 — and the evaluation metrics on the
                  validation pairs after the last step
  renders.json    DPOTrainer's tokenization (prompt_ids, chosen_ids,
                  rejected_ids, read back from trainer.train_dataset) of
                  conversational pairs, explicit and implicit prompt, through
                  the Qwen3, Llama 3.2 and ChatML templates of testdata/chat

Usage: python scripts/make_preference_fixtures.py   (from the repository root)
Versions used for the committed files are recorded in runs.json.
"""
import json
import os
import shutil
import tempfile

import peft
import torch
import transformers
import trl
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoTokenizer, Qwen3ForCausalLM
from trl import DPOConfig, DPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

OUT = "testdata/preference"
MODEL = "testdata/chat/model"
TEMPLATES = "testdata/chat/templates"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 5e-3
STEPS = 5


def chat_pair(sys_msg, a, b, good, bad):
    prompt = ([{"role": "system", "content": sys_msg}] if sys_msg else []) + [
        {"role": "user", "content": f"What is {a} plus {b}?"}]
    return {"prompt": prompt,
            "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}


CHAT = {
    "train": [chat_pair("You are a terse calculator.", 3, 4, "3 plus 4 is 7.", "3 plus 4 is 8."),
              chat_pair(None, 12, 6, "12 plus 6 is 18.", "I do not know.")],
    "valid": [chat_pair(None, 5, 9, "5 plus 9 is 14.", "5 plus 9 is 15."),
              chat_pair("Answer briefly.", 7, 2, "9.", "7 plus 2 is 11.")],
}
STRINGS = {
    "train": [{"prompt": "Q: What is 3 plus 4?\nA:", "chosen": " 7.", "rejected": " 8, I think."},
              {"prompt": "Q: What is 12 plus 6?\nA:", "chosen": " 18.", "rejected": " 20."}],
    "valid": [{"prompt": "Q: What is 5 plus 9?\nA:", "chosen": " 14.", "rejected": " 15."},
              {"prompt": "Q: What is 7 plus 2?\nA:", "chosen": " 9.", "rejected": " 11."}],
}
# Conversational records rendered through each template: explicit prompts
# (with a system message, several turns) and an implicit one.
RENDER_RECORDS = [
    CHAT["train"][0],
    {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Grüße aus 東京 — 2+2?"}],
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "Five, or so.\nMaybe."}]},
    {"chosen": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Seven."}]},
]
SPECIALS = {"qwen3": (None, "<|im_end|>"), "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
            "chatml": (None, "<|im_end|>")}


def write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def base():
    return Qwen3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager")


def make_adapter():
    torch.manual_seed(11)
    model = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    path = os.path.join(OUT, "adapter")
    model.save_pretrained(path)
    # The base as a path relative to the repository, not this machine's.
    cfg_path = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["base_model_name_or_path"] = MODEL
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    readme = os.path.join(path, "README.md")
    if os.path.exists(readme):
        os.remove(readme)


def trained_model():
    return PeftModel.from_pretrained(base(), os.path.join(OUT, "adapter"), is_trainable=True)


NAMES = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
         "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio"]


def run(objective, loss_type, data):
    tok = AutoTokenizer.from_pretrained(MODEL)
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                  learning_rate=LR, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1, beta=0.1,
                  report_to=[], bf16=False, use_cpu=True, save_strategy="no", max_grad_norm=1.0,
                  weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, seed=0,
                  max_length=512, dataloader_drop_last=False, optim="adamw_torch")
    train = Dataset.from_list(data["train"])
    valid = Dataset.from_list(data["valid"])
    if objective == "dpo":
        args = DPOConfig(loss_type=[loss_type], **common)
        trainer = DPOTrainer(model=trained_model(), args=args, train_dataset=train, eval_dataset=valid,
                             processing_class=tok)
    else:
        args = ORPOConfig(**common)
        trainer = ORPOTrainer(model=trained_model(), args=args, train_dataset=train, eval_dataset=valid,
                              processing_class=tok)
    trainer.train()
    steps = [{k: h[k] for k in NAMES if k in h} for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == STEPS, trainer.state.log_history
    ev = trainer.evaluate()
    evals = {k[len("eval_"):]: v for k, v in ev.items()
             if k[len("eval_"):] in NAMES}
    shutil.rmtree(args.output_dir, ignore_errors=True)
    return {"steps": steps, "eval": evals}


def renders():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    out = []
    for name, (bos, eos) in SPECIALS.items():
        src = open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8").read()
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json")),
                                      chat_template=src, bos_token=bos, eos_token=eos, pad_token="<|endoftext|>")
        records = [dict(r) for r in RENDER_RECORDS]
        if name == "llama3":  # the template reads today's date otherwise
            for r in records:
                r["chat_template_kwargs"] = {"date_string": "26 Jul 2024"}
        # Each record alone: a dataset holds one layout (explicit or implicit prompt).
        for r in records:
            args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, max_length=None)
            trainer = DPOTrainer(model=base(), args=args, train_dataset=Dataset.from_list([r]), processing_class=tok)
            row = trainer.train_dataset[0]
            out.append({"template": name, "special": tok.special_tokens_map, "record": r,
                        "prompt_ids": row["prompt_ids"], "chosen_ids": row["chosen_ids"],
                        "rejected_ids": row["rejected_ids"]})
            shutil.rmtree(args.output_dir, ignore_errors=True)
    return out


def main():
    for name, data in (("chat", CHAT), ("strings", STRINGS)):
        for split, recs in data.items():
            write_jsonl(os.path.join(OUT, "data", name, f"{split}.jsonl"), recs)
    make_adapter()
    runs = {"versions": {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                         "torch": torch.__version__},
            "settings": {"lr": LR, "steps": STEPS, "batch": 2, "beta": 0.1, "clip": 1.0},
            "runs": [dict(objective="dpo", loss="sigmoid", data="chat", **run("dpo", "sigmoid", CHAT)),
                     dict(objective="dpo", loss="ipo", data="strings", **run("dpo", "ipo", STRINGS)),
                     dict(objective="dpo", loss="sigmoid", data="strings", **run("dpo", "sigmoid", STRINGS)),
                     dict(objective="orpo", loss=None, data="chat", **run("orpo", None, CHAT))]}
    with open(os.path.join(OUT, "runs.json"), "w", encoding="utf-8") as f:
        json.dump(runs, f, ensure_ascii=False, indent=1)
    with open(os.path.join(OUT, "renders.json"), "w", encoding="utf-8") as f:
        json.dump(renders(), f, ensure_ascii=False, indent=1)
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
