"""An accelerate nlp_example-style custom training loop.

Reproduces: accelerate's examples/nlp_example.py pattern on a tiny random
GPT-2 causal LM: Accelerator(cpu=True, gradient_accumulation_steps=2),
accelerator.prepare(model, optimizer, dataloaders, lr_scheduler), a loop under
accelerator.accumulate() with accelerator.backward() and clip_grad_norm_,
stopping after --max-steps optimizer steps, then a small eval loop under
torch.no_grad() that prints the eval loss. CPU only, no downloads.

    python examples/scripts/accelerate_loop.py --max-steps 3 --micro-batch 4 --seq-len 64
"""
import argparse
import os
import sys
from itertools import chain

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, default_data_collator, get_linear_schedule_with_warmup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_tokenizer, read_lines, tiny_gpt2_config  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
args = parser.parse_args()

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
set_seed(42)
tokenizer = load_tokenizer()


def make_blocks(lines):
    # Concatenate the tokenized lines and cut them into --seq-len blocks; labels = input_ids.
    ids = list(chain(*tokenizer(lines)["input_ids"]))
    n = len(ids) // args.seq_len * args.seq_len
    return [{"input_ids": ids[i : i + args.seq_len], "labels": ids[i : i + args.seq_len]}
            for i in range(0, n, args.seq_len)]


lines = read_lines()
train_dataloader = DataLoader(make_blocks(lines[:-20]), shuffle=True, batch_size=args.micro_batch,
                              collate_fn=default_data_collator)
eval_dataloader = DataLoader(make_blocks(lines[-20:]), batch_size=args.micro_batch, collate_fn=default_data_collator)

model = AutoModelForCausalLM.from_config(tiny_gpt2_config(tokenizer))
optimizer = torch.optim.AdamW(params=model.parameters(), lr=5e-4)
lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=args.max_steps)

model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
)

model.train()
completed_steps = 0
while completed_steps < args.max_steps:
    for step, batch in enumerate(train_dataloader):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            accelerator.print(f"step {completed_steps}: loss {loss.item():.4f}")
            if completed_steps >= args.max_steps:
                break

model.eval()
losses = []
for batch in eval_dataloader:
    with torch.no_grad():
        outputs = model(**batch)
    losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(batch["input_ids"].shape[0])))
eval_loss = torch.cat(losses).mean()
accelerator.print(f"eval loss: {eval_loss.item():.4f}")
