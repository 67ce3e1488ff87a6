"""explain's fixes include what 2026 runs use to save memory (issue 38): on a Llama-3-8B full fine-tune (bf16 mixed
precision, AdamW) that does not fit one 80 GB card, the low-bit optimizers (torchao's 8-bit and 4-bit AdamW,
bitsandbytes' paged 8-bit AdamW) and the optimizer run on the host (torchao's CPUOffloadOptimizer) are among the
fixes that fit, each re-simulated, with its step time; the host-step ones pay for the copies over the host link
and the CPU's Adam, so their step time is above the run's own."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from peakledger.cli import main

LLAMA_8B = ["--preset", "llama-3-8b", "--precision", "bf16-mixed", "--micro-batch", "1", "--seq-len", "2048",
            "--device", "H100-80GB"]


@pytest.fixture(scope="module")
def explained() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["explain", *LLAMA_8B, "--json"]) == 0
    return json.loads(out.getvalue())


def test_low_bit_and_offloaded_optimizers_are_fitting_fixes_with_their_step_time(explained):
    assert not explained["fits"]
    fitting = {f["changes"].get("optimizer") or f["changes"].get("optimizer_offload"): f
               for f in explained["fixes"] if f["fits"] and f["capacity_needed"] <= explained["budget"]
               and ("optimizer" in f["changes"] or "optimizer_offload" in f["changes"])}
    for key in ("adamw-8bit-torchao", "adamw-4bit", "paged-adamw-8bit", "cpu"):
        assert key in fitting, sorted(fitting)
        assert fitting[key]["step_time_s"] > 0
    base = explained["step_time_s"]
    assert fitting["cpu"]["step_time_s"] > 2 * base  # the host step and its copies: slower, said in the table
    assert "host link" in fitting["cpu"]["cost"]
