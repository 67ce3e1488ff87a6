"""HF transformers' MixtralForCausalLM as a reference model, and the router hook that records routing counts.

`hf_mixtral(cfg)` builds the real model from a `MixtralConfig` with the same fields (random weights, nothing
downloaded), behind nanoGPT's call `logits, loss = model(idx, targets)` like `nanogpt.hf_gpt2`, with the
experts implementation transformers picks by default ("grouped_mm" where torch has it; see models/moe.py).

`RoutingRecorder(model)` hooks every layer's router (`mlp.gate`, MixtralTopKRouter: it returns logits,
top-k scores and top-k expert indices) and counts the tokens each expert receives per layer; `document()`
is the "peakledger-moe-counts" JSON that `--moe-routing counts:FILE` reads (models/moe.py `read_counts`).
By default the first forward pass is recorded (the first micro-batch of step 1); `forward_index` picks another.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn as nn

from ...models.config import ConfigError, TransformerConfig
from ...models.moe import counts_document


def hf_mixtral_config(cfg: TransformerConfig):
    """The `transformers.MixtralConfig` of `cfg`: no KV cache, no sliding window, no router aux loss."""
    from transformers import MixtralConfig

    last_token = cfg.vocab_size - 1
    return MixtralConfig(num_hidden_layers=cfg.n_layer, hidden_size=cfg.d_model, num_attention_heads=cfg.n_head,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size, intermediate_size=cfg.ffn,
                         vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len,
                         num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                         tie_word_embeddings=cfg.tied, attn_implementation=cfg.attention, use_cache=False,
                         sliding_window=None, output_router_logits=False, bos_token_id=last_token,
                         eos_token_id=last_token, pad_token_id=None,
                         **({"experts_implementation": cfg.experts_implementation}
                            if cfg.experts_implementation else {}))


@functools.cache
def _adapter_class():
    from transformers import MixtralForCausalLM

    class HFMixtralAdapter(MixtralForCausalLM):
        def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
            out = super().forward(input_ids=idx, labels=idx if targets is not None else None, use_cache=False)
            return out.logits, out.loss

    # transformers decides whether a class may pick its experts implementation by reading its module's source
    # for "@use_experts_implementation" (modeling_utils.py `_can_set_experts_implementation`); this module lacks
    # it, so without the cached answer the adapter would fall back to the eager loop that MixtralForCausalLM
    # itself never runs
    HFMixtralAdapter._can_set_experts_implementation_cached_value = True
    return HFMixtralAdapter


def hf_mixtral(cfg: TransformerConfig, checkpointing: str = "none") -> nn.Module:
    if checkpointing != "none":
        raise ConfigError("checkpointing",
                          f"HF Mixtral runs without activation checkpointing here, not {checkpointing!r}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("implementation", "HF Mixtral reference models need transformers: pip install transformers") \
            from None
    model = _adapter_class()(hf_mixtral_config(cfg))
    model.loss_type = "ForCausalLM"
    return model


class RoutingRecorder:
    """Counts tokens per expert per layer from the routers' top-k indices of one forward pass
    (`forward_index`, counted per router; 0 = the first micro-batch of the run)."""

    def __init__(self, forward_index: int = 0) -> None:
        self.forward_index = forward_index
        self.calls: list[list[int] | None] = []
        self.seen: list[int] = []
        self.top_k = 0
        self.handles = []

    def attach(self, model: nn.Module) -> RoutingRecorder:
        routers = [m for name, m in model.named_modules() if name.endswith(".mlp.gate")]
        if not routers:
            raise ConfigError("moe_routing", "the model has no `.mlp.gate` routers to record")
        self.calls, self.seen = [None] * len(routers), [0] * len(routers)
        self.handles = [r.register_forward_hook(functools.partial(self._hook, i)) for i, r in enumerate(routers)]
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, layer: int, module, args, output) -> None:
        n = self.seen[layer]
        self.seen[layer] += 1
        if n != self.forward_index:
            return
        with torch.no_grad():  # outside the autograd graph; the tracker sees these small int64 tensors as temporaries
            indices = output[2]
            self.top_k = indices.shape[-1]
            self.calls[layer] = [int(c) for c in torch.bincount(indices.reshape(-1), minlength=module.num_experts)]

    def layers(self) -> list[list[int]]:
        if any(c is None for c in self.calls):
            raise ConfigError("moe_routing", f"forward pass {self.forward_index} was not recorded in every layer")
        return [list(c) for c in self.calls]

    def document(self, micro_batch: int, seq_len: int, model: str = "") -> dict:
        return counts_document(self.layers(), micro_batch, seq_len, self.top_k, model=model,
                               source=f"real run, forward pass {self.forward_index}, torch {torch.__version__}")

    def write(self, path: str | Path, micro_batch: int, seq_len: int, model: str = "") -> None:
        Path(path).write_text(json.dumps(self.document(micro_batch, seq_len, model), indent=1) + "\n")
