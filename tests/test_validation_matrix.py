"""A few configs of bench/validate_matrix.py: real CPU training runs under torch.autocast and under
activation checkpointing, held against the simulator."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("validate_matrix",
                                               Path(__file__).resolve().parents[1] / "bench" / "validate_matrix.py")
vm = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("validate_matrix", vm)  # dataclasses look their module up while the file runs
_spec.loader.exec_module(vm)

CASES = [
    vm.Config("adamw", "foreach", "bf16-autocast", "eager", "none", 4, 64),
    vm.Config("sgd-momentum", "foreach", "fp32", "sdpa", "full", 4, 64),
    vm.Config("adamw", "for-loop", "bf16-autocast", "sdpa", "full", 2, 32),
    vm.Config("sgd", "foreach", "bf16", "eager", "none", 2, 32),  # module buffers in the parameters' dtype
    vm.Config("adamw", "foreach", "bf16", "sdpa", "none", 4, 64, "tiny-llama"),  # RMSNorm's upcast on the CPU
    vm.Config("sgd-momentum", "foreach", "bf16", "eager", "none", 2, 32, "tiny-llama"),  # fp32 softmax, cast back
]


@pytest.mark.parametrize("config", CASES, ids=lambda c: c.label)
def test_matrix_config_peak_within_one_percent_and_static_rows_exact(config):
    r = vm.run_config(config)
    assert abs(r["error"]) <= 0.01, (r["measured"], r["predicted"], r["unexplained"])
    assert r["static_exact"], (r["static_measured"], r["static_predicted"])
    assert r["static_measured"][vm.Category.PARAMETER] > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_nanogpt_dropout_masks_on_cpu_take_the_input_dtype(precision):
    from peakledger import validation
    from peakledger.scenario import build_scenario

    scenario = build_scenario({"preset": "tiny", "dropout": 0.1},
                              {"micro_batch": 4, "seq_len": 64, "optimizer": "sgd", "precision": precision})
    result, measured, _ = validation.validate(scenario)
    assert result.passes(0.01), (result.overall, result.unexplained)
    masks = {e.block.dtype for e in measured.events if "dropout" in e.block.name and e.block.nbytes}
    assert masks and "bool" not in masks
