"""Preference tuning with TRL's DPOTrainer (implicit reference model).

Reproduces: the TRL dpo.py quickstart (DPOTrainer + DPOConfig on a standard
prompt/chosen/rejected dataset, ref_model omitted so DPOTrainer builds the
reference model itself) on a tiny random GPT-2. The random initial model is
first saved to <output-dir>/init-model and passed by path, as users pass a
model id: TRL 1.16 re-loads the implicit reference model from
config._name_or_path, which is empty for a model built with from_config.
TRL's config defaults are kept (bf16 autocast, gradient checkpointing on).
CPU only, no downloads.

    python examples/scripts/trl_dpo.py --max-steps 3 --micro-batch 4 --seq-len 64
"""
import argparse
import os
import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, set_seed
from trl import DPOConfig, DPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_tokenizer, read_lines, tiny_gpt2_config  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--output-dir", default="out-dpo")
args = parser.parse_args()

set_seed(42)
tokenizer = load_tokenizer()
init_dir = os.path.join(args.output_dir, "init-model")
AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer)).save_pretrained(init_dir)
tokenizer.save_pretrained(init_dir)

# prompt = first four words of a line, chosen = the rest of that line,
# rejected = the rest of the next line.
lines = read_lines()
split = [line.split(" ", 4) for line in lines]
train_dataset = Dataset.from_dict({
    "prompt": [" ".join(w[:4]) for w in split],
    "chosen": [" " + w[4] for w in split],
    "rejected": [" " + split[(i + 1) % len(split)][4] for i in range(len(split))],
})

training_args = DPOConfig(
    output_dir=args.output_dir,
    use_cpu=True,
    report_to=[],
    seed=42,
    max_steps=args.max_steps,
    per_device_train_batch_size=args.micro_batch,
    learning_rate=5e-4,
    logging_steps=1,
    save_strategy="no",
    dataloader_num_workers=0,
    max_length=args.seq_len,
    beta=0.1,
)

trainer = DPOTrainer(
    model=init_dir,
    args=training_args,
    train_dataset=train_dataset,
    processing_class=tokenizer,
)
trainer.train()
print("final log:", trainer.state.log_history[-1])
