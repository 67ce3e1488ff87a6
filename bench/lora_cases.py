"""The LoRA / QLoRA cases run for real and simulated: tests/test_lora.py asserts them, bench/validate_lora.py tables
them (bench/VALIDATION.md). One list, on the bench side, which the tests read (pytest puts bench/ on the path)."""

from __future__ import annotations

from peakledger import build_scenario

LLAMA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

REAL_RUNS = {
    "llama fp32 lora all linears": ("tiny-llama", dict(precision="fp32", lora_targets=LLAMA_ALL)),
    "llama bf16-autocast lora attention": ("tiny-llama", dict(precision="bf16-autocast", lora_targets=ATTENTION)),
    "llama bf16 lora default targets dropout": ("tiny-llama", dict(precision="bf16", lora_dropout=0.1)),
    "llama bf16 lora checkpointing full": ("tiny-llama", dict(precision="bf16", checkpointing="full")),
    "gpt2 fp32 lora c_attn": ("tiny", dict(precision="fp32")),
    "gpt2 bf16-autocast lora all linears": ("tiny", dict(precision="bf16-autocast",
                                                           lora_targets=("c_attn", "c_proj", "c_fc"))),
    "gpt2 bf16 lora checkpointing full sgd-momentum": ("tiny", dict(precision="bf16", checkpointing="full",
                                                                     optimizer="sgd-momentum")),
    "llama fp32 qlora all linears": ("tiny-llama", dict(precision="fp32", quantize="nf4", lora_targets=LLAMA_ALL)),
    "llama bf16 qlora attention dropout": ("tiny-llama", dict(precision="bf16", quantize="nf4", lora_dropout=0.1,
                                                              lora_targets=ATTENTION)),
    "llama bf16 qlora checkpointing full": ("tiny-llama", dict(precision="bf16", quantize="nf4", checkpointing="full")),
    "gpt2 bf16 qlora all linears": ("tiny", dict(precision="bf16", quantize="nf4",
                                                 lora_targets=("c_attn", "c_proj", "c_fc"))),
    "gpt2 bf16 qlora checkpointing full": ("tiny", dict(precision="bf16", quantize="nf4", checkpointing="full")),
    "llama bf16 lora selective checkpointing": ("tiny-llama", dict(precision="bf16", checkpointing="selective",
                                                                   lora_targets=ATTENTION)),
    "gpt2 fp32 qlora sqrt checkpointing": ("tiny", dict(precision="fp32", quantize="nf4", checkpointing="sqrt")),
}


def lora_scenario(preset_name: str, **training):
    training = {"micro_batch": 2, "seq_len": 32, "lora_r": 4, "lora_alpha": 16.0, **training}
    return build_scenario({"preset": preset_name}, training, {"device": "cpu"})
