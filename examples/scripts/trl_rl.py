"""RL post-training with TRL on a tiny random Qwen2: DPOTrainer or GRPOTrainer, with a reference model.

Reproduces: the TRL dpo.py / grpo.py quickstarts with the policy given by path, so the trainer builds the reference
model itself from the same folder (trl 1.16.0 dpo_trainer.py:916-927, grpo_trainer.py:992-1003); GRPO generates
with HF generate (use_vllm=False), a trivial Python reward, beta > 0. Every prompt, chosen and rejected text has a
fixed token length and generation runs exactly --completion-tokens new tokens (min_new_tokens: generate masks EOS
until then), so the memory does not depend on what is sampled. fp32 and no gradient checkpointing unless asked
(--bf16 --gradient-checkpointing are TRL's own defaults). CPU only, no downloads.

    python examples/scripts/trl_rl.py --make-model /tmp/tiny-qwen2
    python examples/scripts/trl_rl.py --model /tmp/tiny-qwen2 --trainer grpo --steps 2
"""
import argparse
import os
import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, Qwen2Config, set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_tokenizer  # noqa: E402


def tiny_qwen2(vocab):
    """Qwen2 with grouped-query attention: 4 query heads, 2 key/value heads, head_dim 16."""
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_model(folder):
    import torch

    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    AutoModelForCausalLM.from_config(Qwen2Config(**tiny_qwen2(len(tokenizer)))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--make-model", metavar="DIR", help="write the tiny random Qwen2 and the tokenizer to DIR")
    parser.add_argument("--model", help="a local model folder (--make-model writes one)")
    parser.add_argument("--trainer", choices=["dpo", "grpo"], default="grpo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2, help="DPO: pairs; GRPO: completions per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(args.make_model)
        return
    if not args.model:
        parser.error("--model DIR is needed (write one with --make-model DIR)")

    set_seed(args.seed)
    tokenizer = load_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(args.model)
    rows = args.micro_batch * args.grad_accum * args.steps
    prompt = " b" * args.prompt_tokens  # " b", " c", " d": one token each in the tiny tokenizer
    common = dict(output_dir="out-trl-rl", use_cpu=True, report_to=[], seed=args.seed,
                  data_seed=args.seed, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
                  gradient_accumulation_steps=args.grad_accum, learning_rate=1e-4, logging_steps=1,
                  save_strategy="no", dataloader_num_workers=0, bf16=args.bf16,
                  gradient_checkpointing=args.gradient_checkpointing, beta=args.beta, disable_tqdm=True)
    if args.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        data = Dataset.from_dict({"prompt": [prompt] * rows, "chosen": [" c" * args.completion_tokens] * rows,
                                  "rejected": [" d" * args.completion_tokens] * rows})
        trainer = DPOTrainer(model=model, args=DPOConfig(**common, max_length=None), train_dataset=data,
                             processing_class=tokenizer)
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common, num_generations=args.num_generations, num_iterations=args.num_iterations,
                            max_completion_length=args.completion_tokens, use_vllm=False,
                            generation_kwargs={"min_new_tokens": args.completion_tokens})
        trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=config,
                              train_dataset=Dataset.from_dict({"prompt": [prompt] * rows}), processing_class=tokenizer)
    trainer.train()


if __name__ == "__main__":
    main()
