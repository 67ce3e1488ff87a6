"""The mixtral family: HF transformers' MixtralForCausalLM, a Llama with a sparse mixture of experts in place of each
dense MLP, described by hand.

- config       `TransformerConfig` with num_local_experts (and num_experts_per_tok): architecture llama,
               implementation "hf" (models/config/model.py `_check_experts`)
- describer    models/hf_mixtral.py `hf_mixtral_tape` (the experts and the routing: models/moe.py)
- checks       seq_len within max_seq_len; a moe_routing counts file fits the model and the micro-batch
- parallelism  ep (models/parallel/expert.py), with data parallelism
- batch        token ids (micro_batch, seq_len) and their next-token targets
- layers       the per-layer checkpointing search does not run on it (no activation checkpointing)
- LoRA         not modelled: refused by `check` (the describer does not read lora_r), and where the real
               program is built
- reference    traces/reference/mixtral.py `hf_mixtral`, registered against `FAMILY` in traces/reference/build.py
               `PROGRAMS`
- presets      `PRESETS` below
"""

from __future__ import annotations

from ...config import ConfigError, TransformerConfig
from ...hf_mixtral import hf_mixtral_tape
from ...lora import NOT_ON_HF
from ...moe import check_routing
from ..base import Family, refused
from ..transformer import TRANSFORMER, check_seq_len

NO_LORA = ("LoRA on the hand-written Mixtral describer is not modelled (it would be simulated as a full fine-tune); "
           "allowed: lora_r 0, or the HF config traced (--hf-config config.json --describer traced --lora-r R "
           "--lora-targets q_proj,k_proj,v_proj,o_proj)")


def check(model: TransformerConfig, setup) -> None:
    check_seq_len(model, setup)
    check_routing(model, setup)
    if setup.lora.r:  # the describer never reads lora_r: refused, not a full fine-tune under LoRA's name
        raise ConfigError("lora_r", NO_LORA)


PRESETS = (
    # Mixtral-8x7B-v0.1's config.json: 8 experts of width 14336 per layer, top-2 routing, no sliding window
    TransformerConfig(name="mixtral-8x7b", architecture="llama", implementation="hf", n_layer=32, d_model=4096,
                      n_head=32, n_kv_head=8, d_ff=14336, vocab_size=32000, max_seq_len=32768, num_local_experts=8,
                      num_experts_per_tok=2),
)

FAMILY = Family(
    "mixtral", takes=lambda m: isinstance(m, TransformerConfig) and bool(m.num_local_experts), check=check,
    tape=lambda model, setup, cpu, ep_rank, cuda: hf_mixtral_tape(model, setup, cpu, ep_rank),
    experts=True, parallel=frozenset({"ep"}), kind="a mixture of experts", layer_search=False,
    lora_targets=refused("lora_r", NOT_ON_HF), presets=PRESETS, **TRANSFORMER)
