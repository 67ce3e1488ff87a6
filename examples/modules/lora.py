"""peft LoRA on tiny HF models for peakledger's traced describer:
`--module examples/modules/lora.py:llama` and `--module examples/modules/lora.py:gpt2`.

Each factory builds a small transformers model from a config (random weights, nothing downloaded) and
wraps it with `peft.get_peft_model(model, LoraConfig(r=8, ...))`: the base is frozen, only the adapters
train. The batch is input_ids and labels (`model(**batch)`), the loss the model's own.

Under FakeTensorMode (how peakledger traces a factory) peft's `get_peft_model` moves each new adapter with
`Module.to(device, dtype)`, which fake parameters refuse; peakledger calls factories with such moves done by hand
(models/traced/model.py `fake_module_moves`), so the factory is plain peft.
"""

import torch


def _batch(vocab: int, micro_batch: int, seq_len: int) -> dict:
    ids = torch.randint(0, vocab, (micro_batch, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}


def _wrap(model, targets, micro_batch, seq_len, vocab, **lora):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, **lora))
    return model, _batch(vocab, micro_batch, seq_len), lambda out: out.loss


def llama(micro_batch: int = 4, seq_len: int = 64):
    """LlamaForCausalLM (2 layers, hidden 64, GQA 4/2 heads), LoRA on q_proj, k_proj, v_proj and o_proj."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return _wrap(LlamaForCausalLM(config), ["q_proj", "k_proj", "v_proj", "o_proj"], micro_batch, seq_len, 256)


def gpt2(micro_batch: int = 4, seq_len: int = 64):
    """GPT2LMHeadModel (2 layers, n_embd 64, 4 heads), LoRA on the fused c_attn projection and the MLP's
    c_fc (transformers' Conv1D: peft's fan_in_fan_out)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    return _wrap(GPT2LMHeadModel(config), ["c_attn", "c_fc"], micro_batch, seq_len, 256, fan_in_fan_out=True)
