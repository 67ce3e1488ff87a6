"""Online RL with TRL's GRPOTrainer and a trivial Python reward.

Reproduces: the TRL GRPO quickstart (GRPOTrainer + GRPOConfig, a "prompt"
dataset, a Python reward function) on a tiny random GPT-2 model object:
num_generations=2, max_completion_length=8, generation with HF generate
(no vLLM), default beta=0 (no reference model). Prompts are the first half
of each text line, capped at --seq-len - 8 tokens. Reward = completion length
in characters. TRL's config defaults are kept (bf16 autocast, gradient
checkpointing on). CPU only, no downloads.

    python examples/scripts/trl_grpo.py --max-steps 3 --micro-batch 4 --seq-len 64
"""
import argparse
import os
import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, set_seed
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_tokenizer, read_lines, tiny_gpt2_config  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--micro-batch", type=int, default=4, help="completions per device step (multiple of 2)")
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--output-dir", default="out-grpo")
args = parser.parse_args()

MAX_COMPLETION = 8
set_seed(42)
tokenizer = load_tokenizer()
model = AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer))

prompts = []
for ids in tokenizer(read_lines())["input_ids"]:
    prompts.append(tokenizer.decode(ids[: min(len(ids) // 2, args.seq_len - MAX_COMPLETION)]))
train_dataset = Dataset.from_dict({"prompt": prompts})


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


training_args = GRPOConfig(
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
    num_generations=2,
    max_completion_length=MAX_COMPLETION,
    use_vllm=False,
)

trainer = GRPOTrainer(
    model=model,
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=train_dataset,
    processing_class=tokenizer,
)
trainer.train()
print("final log:", trainer.state.log_history[-1])
