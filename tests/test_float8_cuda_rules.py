"""float8 rules found by the CUDA program on the fake CUDA runtime (bench/validate_fakecuda_lowp.py), held against a
real CPU run of torchao 0.18.0's Float8Linear: the backward node's grad_output lives through the grad_weight matmul;
a CUDA capture builds Float8Linear without emulation."""

from __future__ import annotations

import dataclasses
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training, float8_ops  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from peakledger.models import float8  # noqa: E402
from peakledger.traces.reference.float8 import device_matmuls  # noqa: E402


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_grad_output_is_held_through_the_grad_weight_matmul(recipe):
    """In a real emulated run the grad_output's storage is freed only after both backward matmuls (grad_input,
    then grad_weight); the simulation's weight node, where grad_weight's matmul happens, holds a tensor of its
    shape and dtype."""
    M, K, N = 64, 32, 48
    order = []
    original = float8_ops.FLOAT8_OPS_TABLE[torch.ops.aten.mm.default]

    def mm(aten_op, args, kwargs=None):
        order.append("mm")
        return original(aten_op, args, kwargs)

    lin = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).to(torch.bfloat16)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(lin, config=config)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    seen = {}

    def hook(g):
        seen["shape"], seen["dtype"] = tuple(g.shape), g.dtype
        weakref.finalize(g.untyped_storage(), order.append, "grad_output freed")
    y.register_hook(hook)
    loss = y.float().sum()
    float8_ops.FLOAT8_OPS_TABLE[torch.ops.aten.mm.default] = mm
    try:
        loss.backward()
    finally:
        float8_ops.FLOAT8_OPS_TABLE[torch.ops.aten.mm.default] = original
    assert order == ["mm", "mm", "grad_output freed"]
    _, weight_node = float8.backward_workspaces("l", M, K, N, recipe, "bf16", gpu=True)
    held = [t for t in weight_node if t.name == "l.grad_output_held"]
    assert [(t.shape, t.dtype) for t in held] == [(seen["shape"], "bf16")] and seen["dtype"] == torch.bfloat16


def test_device_matmuls_turn_emulation_off():
    """A CUDA capture's Float8Linear runs torch._scaled_mm: emulate off in its config and all three gemm configs
    (torchao copies `config.emulate` into `linear_mm_config` when it builds the module)."""
    lin = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    convert_to_float8_training(lin, config=config)
    device_matmuls(lin)
    (m,) = [m for m in lin.modules() if isinstance(m, Float8Linear)]
    assert m.config.emulate is False and [c.emulate for c in m.linear_mm_config] == [False, False, False]
    assert m.linear_mm_config.output.use_fast_accum is True  # the recipe's other settings kept


def test_mse_loss_keeps_the_unreduced_storage_while_the_loss_is_held():
    """torch's `F.mse_loss` (mean) returns a 0-dim tensor over the whole unreduced storage (Loss.cpp
    `mse_loss_out`): the MLP tape's loss has those bytes, and a real CPU run of the MLP matches the simulation at
    the backward peak but for the loss's 2-byte root gradient (the tape writes none), with and without float8."""
    from peakledger import build_scenario
    from peakledger.validation import validate

    x, t = torch.randn(16, 512, dtype=torch.bfloat16), torch.randn(16, 512, dtype=torch.bfloat16)
    assert torch.nn.functional.mse_loss(x, t).untyped_storage().nbytes() == 16 * 512 * 2
    for fp8 in ("none", "rowwise"):
        training = dict(precision="bf16", fp8=fp8, micro_batch=16, steps=1)
        v, _, _ = validate(build_scenario({"preset": "tiny-mlp"}, training, {"device": "cpu"}))
        phases = {p.label: p for p in v.phases}
        assert phases["forward step 1"].measured == phases["forward step 1"].predicted
        assert phases["backward step 1"].measured - phases["backward step 1"].predicted == 2
