"""The describer-agreement matrix (bench/describer_agreement.py, bench/VALIDATION.md), on a subset that runs in
seconds: an HF config's default answer is the traced describer's (the program transformers runs) in every
precision, checkpointing, LoRA and data-parallel cell; where only the hand-written describers simulate the setup
(model parallelism), the default is theirs."""

from __future__ import annotations

import pytest
from describer_agreement import LORA, PARALLEL, cell  # bench/ (pytest's pythonpath)

pytest.importorskip("transformers")

SUBSET = [(family, precision, lora, ckpt, par, "sdpa") for family in ("gpt2", "llama")
          for precision in ("fp32", "bf16-autocast") for lora in LORA[:1] for ckpt in ("none", "full")
          for par in PARALLEL[:2]] + [("llama", "bf16", LORA[1], "none", {}, "eager")]


@pytest.mark.parametrize("family, precision, lora, ckpt, par, attn", SUBSET)
def test_the_default_path_is_the_traced_program(tmp_path, family, precision, lora, ckpt, par, attn):
    row = cell(tmp_path, family, precision, lora, ckpt, par, attn, device="cpu")
    assert isinstance(row["traced"], int) and row["auto"] == row["traced"], row


def test_model_parallelism_takes_the_hand_written_describer(tmp_path):
    row = cell(tmp_path, "llama", "bf16-mixed", {}, "none", {"tp": 2, "world_size": 2}, "sdpa", device="cpu")
    assert isinstance(row["hand-written"], int) and row["auto"] == row["hand-written"], row
    assert row["traced"] == "refused (tp)"
