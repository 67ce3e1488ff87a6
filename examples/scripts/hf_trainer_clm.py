"""A run_clm-style causal-LM fine-tune with the HF Trainer.

Reproduces: transformers' examples/pytorch/language-modeling/run_clm.py on a
tiny random GPT-2 (2 layers, 64 hidden): tokenize text, group_texts into
--seq-len blocks, labels = input_ids, Trainer with gradient accumulation,
eval every 2 steps on a small held-out set, logging every step, optional
checkpoint saving every 2 steps (--save). CPU only, no downloads.

    python examples/scripts/hf_trainer_clm.py --max-steps 3 --micro-batch 4 --seq-len 64
"""
import argparse
import os
import sys
from itertools import chain

from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator, set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_tokenizer, read_lines, tiny_gpt2_config  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--grad-accum", type=int, default=2)
parser.add_argument("--output-dir", default="out-trainer")
parser.add_argument("--save", action="store_true", help="save a checkpoint every 2 steps")
parser.add_argument("--config", help="a config.json to build the model from (default: a tiny GPT-2)")
parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TrainingArguments.bf16)")
parser.add_argument("--eval-steps", type=int, default=2, help="evaluate every N steps (0: no evaluation)")
parser.add_argument("--repeat", type=int, default=1, help="the text this many times (long --seq-len blocks)")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: train on the GPU")
args = parser.parse_args()

set_seed(42)
tokenizer = load_tokenizer()
if args.config:
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config))
else:
    model = AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer))

lines = read_lines() * args.repeat
raw = {"train": Dataset.from_dict({"text": lines[:-20]}), "validation": Dataset.from_dict({"text": lines[-20:]})}


def tokenize_function(examples):
    return tokenizer(examples["text"])


def group_texts(examples):
    # Concatenate all texts and split them into chunks of block_size (as in run_clm.py).
    concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
    total_length = (len(concatenated["input_ids"]) // args.seq_len) * args.seq_len
    result = {k: [t[i : i + args.seq_len] for i in range(0, total_length, args.seq_len)]
              for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result


lm = {}
for split, ds in raw.items():
    ds = ds.map(tokenize_function, batched=True, remove_columns=["text"])
    lm[split] = ds.map(group_texts, batched=True)

training_args = TrainingArguments(
    output_dir=args.output_dir,
    use_cpu=args.device == "cpu",
    report_to=[],
    seed=42,
    max_steps=args.max_steps,
    per_device_train_batch_size=args.micro_batch,
    per_device_eval_batch_size=args.micro_batch,
    gradient_accumulation_steps=args.grad_accum,
    learning_rate=5e-4,
    optim="adamw_torch",
    eval_strategy="steps" if args.eval_steps else "no",
    eval_steps=args.eval_steps or None,
    bf16=args.bf16,
    logging_steps=1,
    save_strategy="steps" if args.save else "no",
    save_steps=2,
    dataloader_num_workers=0,
)

trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=lm["train"],
    eval_dataset=lm["validation"],
    processing_class=tokenizer,
    data_collator=default_data_collator,
)
train_result = trainer.train()
print("train metrics:", train_result.metrics)
print("eval metrics:", trainer.evaluate())
