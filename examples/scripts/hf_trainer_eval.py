"""HF Trainer's evaluate with metrics: the logits of every eval batch kept until `eval_accumulation_steps`.

Reproduces: a Trainer run with `compute_metrics` (so `prediction_step` returns the logits), `eval_strategy="steps"`
and optionally `eval_accumulation_steps`: without it the evaluation loop concatenates each batch's logits onto
the ones before (transformers' trainer.py `evaluation_loop`, `EvalLoopContainer.add`: nested_concat) until the
end; with it they go to the CPU as numpy every N batches. A tiny random Llama on random token ids. CPU only, no
downloads.

    python examples/scripts/hf_trainer_eval.py --eval-batches 6 --eval-accumulation-steps 2
"""
import argparse

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=1, help="training steps, each followed by an evaluation "
                    "(0: trainer.evaluate() alone)")
parser.add_argument("--micro-batch", type=int, default=2)
parser.add_argument("--eval-batch", type=int, default=2)
parser.add_argument("--eval-batches", type=int, default=4, help="batches in the eval set")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--eval-accumulation-steps", type=int, default=0, help="0: none (the Trainer's default)")
parser.add_argument("--output-dir", default="out-eval")
args = parser.parse_args()

torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, use_cache=False)
model = AutoModelForCausalLM.from_config(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(3, 512, (n, args.seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def accuracy(pred) -> dict:
    predictions = np.argmax(pred.predictions[:, :-1], axis=-1)
    return {"accuracy": float((predictions == pred.label_ids[:, 1:]).mean())}


training_args = TrainingArguments(
    output_dir=args.output_dir, use_cpu=True, report_to=[], seed=42, max_steps=max(args.max_steps, 1),
    per_device_train_batch_size=args.micro_batch, per_device_eval_batch_size=args.eval_batch,
    learning_rate=1e-4, optim="adamw_torch", eval_strategy="steps", eval_steps=1, logging_steps=1,
    save_strategy="no", dataloader_num_workers=0,
    eval_accumulation_steps=args.eval_accumulation_steps or None,
)
trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(8, 1),
                  eval_dataset=Tokens(args.eval_batches * args.eval_batch, 2), compute_metrics=accuracy)
if args.max_steps:
    trainer.train()
else:
    trainer.evaluate()
