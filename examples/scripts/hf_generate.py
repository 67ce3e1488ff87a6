"""HF `generate` inside a training loop: a few AdamW steps on a tiny random decoder, then generation.

Reproduces: the common "sample some completions every N steps" pattern: train, then `model.generate` on a batch of
prompts with a KV cache (dynamic: DynamicCache, the default; static: StaticCache of max_length), greedy or
sampling with several sequences per prompt. The model is a tiny random Llama (GQA: 4 query heads, 2 key/value
heads) or Mistral with a sliding window (--model mistral-sliding). CPU only, no downloads.

    python examples/scripts/hf_generate.py --cache dynamic --max-new-tokens 8 --num-return-sequences 2 --do-sample
"""
import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=["llama-gqa", "mistral-sliding"], default="llama-gqa")
parser.add_argument("--train-steps", type=int, default=1, help="AdamW steps before generating")
parser.add_argument("--micro-batch", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--prompts", type=int, default=2, help="prompts generated from")
parser.add_argument("--prompt-len", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=8)
parser.add_argument("--num-return-sequences", type=int, default=1)
parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
parser.add_argument("--do-sample", action="store_true")
parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the model's parameters")
args = parser.parse_args()

torch.manual_seed(0)
common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
config = (LlamaConfig(**common) if args.model == "llama-gqa" else MistralConfig(**common, sliding_window=8))
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

for _ in range(args.train_steps):
    ids = torch.randint(3, 512, (args.micro_batch, args.seq_len))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

model.eval()
prompts = torch.randint(3, 512, (args.prompts, args.prompt_len))
out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.max_new_tokens,
                     min_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                     num_return_sequences=args.num_return_sequences, cache_implementation=args.cache,
                     top_k=0 if args.do_sample else None, top_p=1.0 if args.do_sample else None)
print("generated", tuple(out.shape))
model.train()
