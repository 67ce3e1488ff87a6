"""Preference tuning with TRL's DPOTrainer and a reference model.

Reproduces: the TRL dpo.py quickstart (DPOTrainer + DPOConfig on a standard
prompt/chosen/rejected dataset) on a tiny random GPT-2. By default the policy
and the reference model are model objects built from the config (a copy of the
policy's initial weights is the reference). With `--model DIR` (a local model
folder, as users pass a model id: `python examples/scripts/common.py
--make-model DIR` writes one) the model is passed by path and DPOTrainer builds
the reference model itself (TRL 1.16 re-loads it from config._name_or_path).
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
parser.add_argument("--model", help="a local model folder (default: a tiny random GPT-2 saved to the output dir)")
args = parser.parse_args()

set_seed(42)
tokenizer = load_tokenizer()
if args.model is None:
    model = AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer))
    ref_model = AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer))
    ref_model.load_state_dict(model.state_dict())
else:
    model, ref_model = args.model, None

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
    model=model,
    ref_model=ref_model,
    args=training_args,
    train_dataset=train_dataset,
    processing_class=tokenizer,
)
trainer.train()
print("final log:", trainer.state.log_history[-1])
