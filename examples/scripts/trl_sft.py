"""Supervised fine-tuning with TRL's SFTTrainer.

Reproduces: the TRL `trl sft` / sft.py quickstart (SFTTrainer + SFTConfig on a
"text" dataset) on a tiny random GPT-2 model object and a local tokenizer.
Sequences are truncated to --seq-len; no packing. TRL's config defaults are
kept (bf16 autocast, gradient checkpointing on). CPU only, no downloads.

    python examples/scripts/trl_sft.py --max-steps 3 --micro-batch 4 --seq-len 64
"""
import argparse
import os
import sys

from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, set_seed
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_tokenizer, read_lines, tiny_gpt2_config  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--output-dir", default="out-sft")
parser.add_argument("--config", help="a config.json to build the model from (default: a tiny GPT-2)")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: train on the GPU")
parser.add_argument("--repeat", type=int, default=1, help="the text this many times")
args = parser.parse_args()

set_seed(42)
tokenizer = load_tokenizer()
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config) if args.config
                                         else tiny_gpt2_config(tokenizer))

lines = read_lines() * args.repeat
# Two sentences per example, so examples have varied lengths.
train_dataset = Dataset.from_dict({"text": [" ".join(lines[i : i + 2]) for i in range(0, len(lines), 2)]})

training_args = SFTConfig(
    output_dir=args.output_dir,
    use_cpu=args.device == "cpu",
    report_to=[],
    seed=42,
    max_steps=args.max_steps,
    per_device_train_batch_size=args.micro_batch,
    learning_rate=5e-4,
    logging_steps=1,
    save_strategy="no",
    dataloader_num_workers=0,
    max_length=args.seq_len,
    dataset_text_field="text",
)

trainer = SFTTrainer(
    model=model,
    args=training_args,
    train_dataset=train_dataset,
    processing_class=tokenizer,
)
trainer.train()
print("final log:", trainer.state.log_history[-1])
