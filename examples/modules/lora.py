"""peft LoRA on tiny HF models for peakledger's traced describer:
`--module examples/modules/lora.py:llama` and `--module examples/modules/lora.py:gpt2`.

Each factory builds a small transformers model from a config (random weights, nothing downloaded) and
wraps it with `peft.get_peft_model(model, LoraConfig(r=8, ...))`: the base is frozen, only the adapters
train. The batch is input_ids and labels (`model(**batch)`), the loss the model's own.

Under FakeTensorMode (how peakledger traces a factory) peft's `get_peft_model` fails as it is: after
making each adapter it moves it to the base layer's device and dtype (`.to(device, dtype=...)`), and
torch's `Module._apply` swaps a FakeTensor parameter in place with `torch.utils.swap_tensors`, which
refuses a tensor with a weakref ("Couldn't swap Linear.weight": fake tensors carry one); the same for
the `.to(weight.device)` of each new LoRA module. The adapters are already made on the base's device
(CPU) and dtype (fp32 here), so those moves change nothing; `_no_fake_move` skips them while the model
is fake and leaves peft untouched for real runs.
"""

import contextlib

import torch


def _batch(vocab: int, micro_batch: int, seq_len: int) -> dict:
    ids = torch.randint(0, vocab, (micro_batch, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}


@contextlib.contextmanager
def _no_fake_move(model):
    """While `model` is fake: `Module.to(device, dtype)` that would change nothing returns the module as
    it is instead of swapping every parameter (which fake parameters refuse)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(next(model.parameters()), FakeTensor):
        yield
        return
    to = torch.nn.Module.to

    def same_or_to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = list(self.parameters()) + list(self.buffers())
        if all((device is None or t.device == device) and (dtype is None or not t.is_floating_point()
                                                           or t.dtype == dtype) for t in tensors):
            return self
        return to(self, *args, **kwargs)

    torch.nn.Module.to = same_or_to
    try:
        yield
    finally:
        torch.nn.Module.to = to


def _wrap(model, targets, micro_batch, seq_len, vocab, **lora):
    from peft import LoraConfig, get_peft_model

    with _no_fake_move(model):
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
