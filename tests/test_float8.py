"""float8 training (models/float8.py, `--fp8`): the rules held against torchao 0.18.0's own objects and a real CPU
run of its Float8Linear in emulation (traces/reference/float8.py), never the simulator against itself."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_ops import preprocess_addmm  # noqa: E402
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402

from peakledger import build_scenario  # noqa: E402
from peakledger.cli import main  # noqa: E402
from peakledger.models import float8  # noqa: E402
from peakledger.models.config import ConfigError, TrainingSetup  # noqa: E402
from peakledger.models.presets import preset  # noqa: E402
from peakledger.models.training import build_tape, describe  # noqa: E402
from peakledger.simulator.events import Phase  # noqa: E402
from peakledger.traces.reference.build import build_model  # noqa: E402
from peakledger.traces.tracker import DTYPE_NAMES  # noqa: E402
from peakledger.validation import validate  # noqa: E402

logging.getLogger("torchao").setLevel(logging.ERROR)
RECIPES = ("tensorwise", "rowwise")


def setup_for(recipe: str, **kw) -> TrainingSetup:
    return TrainingSetup(precision="bf16", fp8=recipe, micro_batch=2, seq_len=32, **kw)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_converted_linears_are_torchaos(name):
    """The describer's float8 linears are the ones convert_to_float8_training swaps (torchtitan's filter)."""
    cfg, setup = preset(name), setup_for("tensorwise")
    model = build_model(cfg, setup)
    real = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    plain = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not isinstance(m, Float8Linear)}
    tape = build_tape(cfg, setup, cpu=True)
    ops = {op.name for op in tape.ops if op.kind == "float8_linear"}
    assert real and ops == real
    assert "lm_head" in plain and not any(op.name in plain for op in tape.ops if op.kind == "float8_linear")


def test_saved_tensors_are_the_bf16_input_and_weight():
    """matmul_with_hp_or_float8_args saves input_hp and weight_hp_t (no float8 copy): the tape saves the input
    and lists the weight as a saved parameter."""
    lin = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(lin, config=dataclasses.replace(Float8LinearConfig(), emulate=True))
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        lin(x)
    assert [(t.dtype, tuple(t.shape)) for t in packed] == [(torch.bfloat16, (2, 8, 32)), (torch.bfloat16, (32, 48))]
    assert packed[1].untyped_storage().data_ptr() == lin[0].weight.untyped_storage().data_ptr()
    tape = build_tape(preset("tiny"), setup_for("tensorwise"), cpu=True)
    op = next(op for op in tape.ops if op.kind == "float8_linear")
    assert op.saves == (op.inputs[0],) and op.saved_params == (f"{op.name}.weight",)


@pytest.mark.parametrize("recipe", RECIPES)
def test_casts_are_torchaos(recipe):
    """Each cast's float8 dtype and scale shape, from torchao's hp_tensor_to_float8_dynamic with the recipe's
    CastConfigs (the dims float8_linear.py passes)."""
    c = Float8LinearConfig.from_recipe_name(recipe)
    M, K, N = 64, 32, 48
    x, w_t, go = (torch.randn(M, K, dtype=torch.bfloat16), torch.randn(N, K, dtype=torch.bfloat16).t(),
                  torch.randn(M, N, dtype=torch.bfloat16))
    casts = [(x, c.cast_config_input, -1, "input"), (w_t, c.cast_config_weight, 0, "weight"),
             (go, c.cast_config_grad_output, -1, "grad_output"),
             (w_t, c.cast_config_weight_for_grad_input, -1, "weight"),
             (go, c.cast_config_grad_output_for_grad_weight, 0, "grad_output"),
             (x, c.cast_config_input_for_grad_weight, 0, "input")]
    for t, cc, dim, role in casts:
        real = hp_tensor_to_float8_dynamic(t, cc.target_dtype, LinearMMConfig(),
                                           scaling_granularity=cc.scaling_granularity,
                                           axiswise_dim=get_maybe_axiswise_dim(dim, cc.scaling_granularity),
                                           round_scales_to_power_of_2=c.round_scales_to_power_of_2)
        data, scale, temps = float8.cast("t", tuple(t.shape), float8.FP8[recipe][role], recipe, dim)
        assert (data.dtype, data.shape) == (DTYPE_NAMES[real._data.dtype], tuple(real._data.shape))
        assert (scale.dtype, scale.shape) == (DTYPE_NAMES[real._scale.dtype], tuple(real._scale.shape))
        assert data.nbytes == real._data.untyped_storage().nbytes()
        assert sum(s.nbytes for s in temps) == 2 * t.numel() * 4  # x.to(float32) * scale and its clamp


def test_gpu_layout_copies_are_preprocess_addmms():
    """The copies _scaled_mm's layouts need: torchao's preprocess_addmm (run before the emulate branch, so on a
    CPU too) on the backward's operands; new storages are copies."""
    M, K, N = 64, 32, 48
    cfg = LinearMMConfig()

    def fp8(t, role, dtype=torch.float8_e4m3fn):
        return hp_tensor_to_float8_dynamic(t, dtype, cfg, gemm_input_role=role)

    go = torch.randn(M, N, dtype=torch.bfloat16)
    w_t = torch.randn(N, K, dtype=torch.bfloat16).t()
    x = torch.randn(M, K, dtype=torch.bfloat16)
    copies = {}
    for gemm, a, b in (("output", fp8(x, GemmInputRole.INPUT), fp8(w_t, GemmInputRole.WEIGHT)),
                       ("grad_input", fp8(go, GemmInputRole.GRAD_OUTPUT, torch.float8_e5m2),
                        fp8(w_t, GemmInputRole.WEIGHT).t()),
                       ("grad_weight", fp8(go, GemmInputRole.GRAD_OUTPUT, torch.float8_e5m2).t(),
                        fp8(x, GemmInputRole.INPUT))):
        ad, _, bd, _ = preprocess_addmm(a, b)
        copies[gemm] = sorted(d.untyped_storage().nbytes() for d, s in ((ad, a), (bd, b))
                              if d.untyped_storage().data_ptr() != s._data.untyped_storage().data_ptr())
    stages = float8.backward_stages("l", M, K, N, "tensorwise", "bf16", gpu=True)
    cpu = float8.backward_stages("l", M, K, N, "tensorwise", "bf16", gpu=False)
    extra = [sorted(t.nbytes for t in g if t.name not in {c.name for c in s}) for g, s in zip(stages, cpu)]
    assert copies["output"] == []
    assert extra[2] == copies["grad_input"] == [N * K]
    assert extra[5] == copies["grad_weight"] == sorted([M * N, M * K])


@pytest.mark.parametrize("name,recipe", [("tiny", "tensorwise"), ("tiny-llama", "rowwise"), ("tiny-mlp", "rowwise")])
def test_emulated_run_matches(name, recipe):
    """A real CPU run of torchao's Float8Linear (emulate=True) under the tracker vs the cpu profile: the float8
    tensors the same count and bytes; the backward peak within the 4 B of two scalars the tracker sees (as
    without float8); the forward peak exact for nanoGPT and the MLP (whose first layer's input needs no gradient,
    yet torchao's backward runs); Llama's differs without float8 too: bench/VALIDATION.md."""
    training = dict(precision="bf16", fp8=recipe, micro_batch=2, steps=2, **({} if name == "tiny-mlp" else
                                                                            {"seq_len": 32}))
    v, measured, simulated = validate(build_scenario({"preset": name}, training, {"device": "cpu"}))

    def fp8_allocs(log, phase, by_name):
        blocks = [e.block for e in log.events if e.action.value == "alloc" and e.phase == phase and e.step == 1
                  and e.block.dtype.startswith("fp8")]
        if by_name:
            blocks = list({b.name: b for b in blocks}.values())
        return len(blocks), sum(b.nbytes for b in blocks)
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert fp8_allocs(measured, phase, False) == fp8_allocs(simulated, phase, True)
    peaks = {p.label: p for p in v.phases}
    assert 0 <= peaks["backward step 1"].measured - peaks["backward step 1"].predicted <= 4
    assert peaks["optimizer step 1"].measured == peaks["optimizer step 1"].predicted
    if name != "tiny-llama":
        assert peaks["forward step 1"].measured == peaks["forward step 1"].predicted


def test_refused_where_float8_does_not_run(capsys):
    with pytest.raises(ConfigError, match="fp8.*compute capability >= 8.9.*A100-80GB is sm80"):
        describe(preset("tiny"), setup_for("tensorwise"), "A100-80GB")
    with pytest.raises(ConfigError, match="fp8.*precision bf16.*'fp32'"):
        TrainingSetup(fp8="rowwise")
    config = str(Path(__file__).resolve().parents[1] / "examples" / "hf-llama-tiny" / "config.json")
    assert main(["simulate", "--hf-config", config, "--describer", "traced",
                 "--precision", "bf16", "--fp8", "rowwise", "--device", "cpu"]) == 2
    assert "fp8: float8 training is modelled in the hand-written describers" in capsys.readouterr().err
    assert main(["simulate", "--preset", "tiny", "--fp8", "bf8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fp8" in err and "tensorwise" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("recipe", RECIPES)
def test_h100_holds_the_float8_tensors(recipe):
    """On an sm 9.0 profile the grad_weight matmul's moment holds preprocess_addmm's copies (and rowwise's fp32
    post-scale, addmm_float8_unwrapped); the weights, their gradients and the optimizer states stay bf16."""
    graph = describe(preset("tiny"), setup_for(recipe, steps=1), "H100-80GB")
    names = {b.name: b for op in graph.ops_in_order() for b in op.allocs}
    layer = "transformer.h.0.mlp.c_fc"
    assert names[f"{layer}.grad_output_t_contig"].dtype == ("fp8_e5m2" if recipe == "tensorwise" else "fp8_e4m3")
    assert names[f"{layer}.input_colmajor"].dtype == "fp8_e4m3"
    assert (f"{layer}.grad_weight_post_scale" in names) == (recipe == "rowwise")
    assert {names[f"{layer}.weight.grad"].dtype, names[f"{layer}.weight.exp_avg"].dtype} == {"bf16"}
