"""A torchrun training script with DistributedDataParallel, as the PyTorch DDP tutorial writes it.

    torchrun --nproc-per-node 2 examples/scripts/ddp_loop.py                # gloo on the CPU, nccl on GPUs
    peakledger run examples/scripts/ddp_loop.py --world-size 8

A 2-layer GPT-2 from examples/hf-gpt2-tiny (random weights), AdamW, random token ids.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "hf-gpt2-tiny" / "config.json"))
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
torch.manual_seed(0)

with open(args.config) as f:
    config = AutoConfig.for_model(**json.load(f))
model = DDP(AutoModelForCausalLM.from_config(config).to(device))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")

dist.destroy_process_group()
