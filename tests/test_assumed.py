"""Every answer says what it assumed (issue 37): the loop, the batch, the steps, the precision and optimizer, the
device's rules and what is not simulated, in the text and in --json, for each command that answers from a
scenario. The loop is the assumption that moves the figure most on a small model (GPT-2: the default loop holds
the logits through backward, HF Trainer's step drops them), so the test checks the printed loop is the one run."""

from __future__ import annotations

import json

import pytest
from cli_run import cli

TINY = ["--preset", "tiny", "--seq-len", "32", "--micro-batch", "2"]


COMMANDS = {
    "where": ["where", *TINY, "--devices", "T4-16GB", "--no-max-batch"],
    "where --min-gpus": ["where", *TINY, "--devices", "T4-16GB", "--min-gpus", "--layouts", "fsdp2"],
    "explain": ["explain", *TINY, "--budget", "1GiB"],
    "max-batch": ["max-batch", *TINY, "--budget", "1GiB"],
    "checkpointing": ["checkpointing", *TINY],
    "compare": ["compare", *TINY],
}


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("loop", ["plain", "hf-trainer"])
def test_each_answer_prints_its_loop_and_batch(name, loop):
    rc, text, err = cli(*COMMANDS[name], "--loop", loop)
    assert rc == 0, err
    block = text[text.index("\nassumed:\n"):]
    assert f"  loop: {loop} (" in block
    assert "  batch: micro-batch " + ("the largest that fits" if name == "max-batch" else "2 x accumulation 1") \
        in block and "seq_len 32; 2 steps" in block
    assert "  not simulated: evaluation or generation inside training (peakledger run records them" in block
    assert "  device: " + ("each card of the table in turn" if name.startswith("where") else "H100-80GB") in block
    rc, out, err = cli(*COMMANDS[name], "--loop", loop, "--json")
    assert rc == 0, err
    said = json.loads(out)["assumed"]
    assert said["loop"].startswith(f"{loop} (") and "seq_len 32" in said["batch"]


def test_sweep_prints_the_base_scenarios_assumptions(tmp_path):
    rc, text, err = cli("sweep", *TINY, "--device", "cpu", "--grid", "micro_batch=1,2", "--output",
                        str(tmp_path / "s.csv"))
    assert rc == 0, err
    assert "\nassumed:\n  loop: plain (" in text and "each point changes what the grid names" in text
    assert "  device: cpu: no CUDA context or caching allocator" in text
