"""A torchrun training script with FSDP2 (`fully_shard`), as torchtitan and the FSDP2 tutorial write it.

    torchrun --nproc-per-node 2 examples/scripts/fsdp2_loop.py             # gloo on the CPU, nccl on GPUs
    peakledger run examples/scripts/fsdp2_loop.py --world-size 64          # predicted at 64 ranks, no process group

Each transformer block is its own FSDP2 unit, then the root; AdamW over the sharded (DTensor) parameters; random
token ids. The model is built from a config (random weights, no download): `--config` a config.json (default: the
2-layer GPT-2 of examples/hf-gpt2-tiny).
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "hf-gpt2-tiny" / "config.json"))
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
torch.manual_seed(0)

with open(args.config) as f:
    config = AutoConfig.for_model(**json.load(f))
with torch.device(device):
    model = AutoModelForCausalLM.from_config(config)
for block in model.transformer.h:
    fully_shard(block)
fully_shard(model)
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
