"""The nanogpt family: peakledger's own plain-torch transformers, GPT-2 as nanoGPT writes it and a small HF-named
Llama, described by hand.

- config       `TransformerConfig` (models/config/model.py), implementation "nanogpt", no experts; architecture
               gpt2 or llama (written `family` in files and flags)
- describer    models/transformer/nanogpt.py `transformer_tape` (on writer.py, attention.py, params.py)
- checks       seq_len within max_seq_len; no moe_routing (no experts); LoRA's targets (the describer checks them)
- LoRA         peft's target_modules on the block linears, its default by architecture (models/lora.py `targets`)
- parallelism  tp, pp, cp (models/parallel/: tensor/, pipeline.py, context.py) and the mesh of them
- batch        token ids (micro_batch, seq_len) and their next-token targets
- reference    traces/reference/nanogpt.py `GPT`, registered against `FAMILY` in traces/reference/build.py
               `PROGRAMS` (a real torch program is the traces layer's: models/ cannot import it)
- presets      `PRESETS` below
"""

from __future__ import annotations

from ...config import TransformerConfig
from ...lora import targets
from ...moe import no_routing
from ...transformer import transformer_tape
from ..base import Family
from ..transformer import TRANSFORMER, check_seq_len


def check(model: TransformerConfig, setup) -> None:
    check_seq_len(model, setup)
    no_routing(model, setup)


PRESETS = (
    TransformerConfig(name="tiny", architecture="gpt2", n_layer=2, d_model=64, n_head=4, vocab_size=256,
                      max_seq_len=64, attention="eager"),
    TransformerConfig(name="tiny-llama", architecture="llama", n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=176,
                      vocab_size=256, max_seq_len=64),
    TransformerConfig(name="gpt2", architecture="gpt2", n_layer=12, d_model=768, n_head=12, vocab_size=50257,
                      max_seq_len=1024),
    TransformerConfig(name="gpt2-medium", architecture="gpt2", n_layer=24, d_model=1024, n_head=16,
                      vocab_size=50257, max_seq_len=1024),
    TransformerConfig(name="llama-3-8b", architecture="llama", n_layer=32, d_model=4096, n_head=32, n_kv_head=8,
                      d_ff=14336, vocab_size=128256, max_seq_len=8192),
    TransformerConfig(name="llama-3-70b", architecture="llama", n_layer=80, d_model=8192, n_head=64, n_kv_head=8,
                      d_ff=28672, vocab_size=128256, max_seq_len=8192),
    # Llama-3.1-405B's config.json (meta-llama): 126 layers, so pipeline stages split unevenly
    TransformerConfig(name="llama-3.1-405b", architecture="llama", n_layer=126, d_model=16384, n_head=128,
                      n_kv_head=8, d_ff=53248, vocab_size=128256, max_seq_len=131072),
    TransformerConfig(name="mistral-7b", architecture="llama", n_layer=32, d_model=4096, n_head=32, n_kv_head=8,
                      d_ff=14336, vocab_size=32000, max_seq_len=32768),
)

FAMILY = Family(
    "nanogpt", takes=lambda m: isinstance(m, TransformerConfig), check=check,
    tape=lambda model, setup, cpu, ep_rank, cuda: transformer_tape(model, setup, cpu, cuda[1] if cuda else "2.6"),
    parallel=frozenset({"tp", "pp", "cp"}), lora_targets=targets, presets=PRESETS, **TRANSFORMER)
