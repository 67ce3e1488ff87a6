"""A plain PyTorch training loop of an HF causal LM, written the two ways users write it.

    python examples/scripts/plain_loop.py --loop held      # out = model(**batch); out.loss.backward(): `out` (and
                                                           # its logits) stays alive through backward
    python examples/scripts/plain_loop.py --loop dropped   # loss = compute_loss(model, batch): the outputs are
                                                           # dropped before backward, as HF Trainer's step does

The model is built from a config (random weights, no download): `--config` a config.json (default: a 2-layer
GPT-2 of examples/hf-gpt2-tiny), or `gpt2` for GPT-2 124M. Data: random token ids, as a benchmark would.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "hf-gpt2-tiny" / "config.json"))
parser.add_argument("--loop", choices=["held", "dropped"], default="held")
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--grad-accum", type=int, default=1)
parser.add_argument("--lr", type=float, default=1e-4)
args = parser.parse_args()

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
if args.config == "gpt2":  # GPT-2 124M
    config = AutoConfig.for_model("gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
else:
    with open(args.config) as f:
        config = AutoConfig.for_model(**json.load(f))
model = AutoModelForCausalLM.from_config(config).to(device)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def batches():
    while True:
        ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len))
        yield {"input_ids": ids.to(device), "labels": ids.to(device)}


def compute_loss(model, batch):
    return model(**batch).loss


data = batches()
for step in range(args.steps):
    for _ in range(args.grad_accum):
        batch = next(data)
        if args.loop == "held":
            out = model(**batch)
            (out.loss / args.grad_accum).backward()
        else:
            loss = compute_loss(model, batch) / args.grad_accum
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {(out.loss if args.loop == 'held' else loss).item():.4f}")
