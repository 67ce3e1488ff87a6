"""torch.compile (models/compile): the compiled describer held against real compiled CPU runs measured with
torch.profiler (traces/compiled_run.py), what compile saves against eager by category, and bad input.

Compiling is slow on a small machine (a tiny model: ~10 s on fake tensors, ~25 s for real): each real run is one
module-scoped fixture, and the simulations reuse the compile cached in the process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peakledger import diagnosis
from peakledger.analysis.validate import compare_logs
from peakledger.api import run
from peakledger.cli import main
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.devices import DEVICES
from peakledger.models.presets import PRESETS
from peakledger.models.traced import from_hf_dict, from_module_spec
from peakledger.models.training import describe
from peakledger.scenario import Scenario
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Category
from peakledger.validation import validate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPT2 = EXAMPLES / "hf-gpt2-tiny" / "config.json"
LLAMA = EXAMPLES / "hf-llama-tiny" / "config.json"
CNN = f"{EXAMPLES / 'modules' / 'cnn.py'}:factory"


def _model(path: Path | str):
    if isinstance(path, str):  # a --module spec
        return from_module_spec(path)
    return from_hf_dict(json.loads(path.read_text()), path.parent.name)


def _setup(**kw) -> TrainingSetup:
    return TrainingSetup(**{**dict(micro_batch=2, seq_len=32, steps=2, precision="fp32", compile=True), **kw})


CASES = {  # name -> (config, setup overrides, tolerance of each phase's peak)
    "gpt2-fp32": (GPT2, {}, 0.005),
    "llama-fp32": (LLAMA, {}, 0.005),
    # bf16 under autocast: oneDNN's GEMMs take a scratchpad of their own (models/compile/workspace.py), measured
    "gpt2-bf16-autocast": (GPT2, {"precision": "bf16-autocast"}, 0.005),
    # a CNN: inductor's channels-last layouts (the weights' and images' copies saved for backward), oneDNN's
    # convolution backward (its weight gradient made three times), AccumulateGrad's copy of a channels-last gradient
    "cnn-fp32": (CNN, {"micro_batch": 8}, 0.005),
    # activation checkpointing: each block under non-reentrant checkpoint, one higher-order op in dynamo's graph,
    # recomputed by AOTAutograd's partitioner in the backward graph
    "gpt2-fp32-full": (GPT2, {"checkpointing": "full"}, 0.005),
    # selective activation checkpointing: torch's selective checkpoint contexts (models/tape.py `op_policy`), whose
    # must-save / prefer-recompute tags the partitioner follows
    "gpt2-fp32-op-policy": (GPT2, {"checkpointing": "op-policy"}, 0.005),
    # peft LoRA: frozen base weights (read by inductor's kernels only), and on GPT-2 a graph break (HF's loss):
    # the logits' gradient handed from one compiled backward to the next
    "gpt2-fp32-lora": (GPT2, {"lora_r": 8}, 0.005),
    "llama-bf16-autocast-lora": (LLAMA, {"lora_r": 8, "precision": "bf16-autocast"}, 0.005),
}


@pytest.fixture(scope="module", params=list(CASES))
def real(request):
    import torch

    path, kw, _ = CASES[request.param]
    scenario = Scenario(name=request.param, model=_model(path), setup=_setup(**kw), device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the describer compiles for the real run's threads (step.py CPU_THREADS), not ours
    try:
        return request.param, validate(scenario)
    finally:
        torch.set_num_threads(threads)


def test_compiled_step_matches_the_real_compiled_run(real):
    name, (result, measured, simulated) = real
    assert measured.source.startswith("torch-profiler")
    assert abs(result.overall.error) <= 0.005, name
    assert abs(result.overall.measured - result.overall.predicted) <= 64, (name, result.overall)
    for phase in result.phases:  # every phase of both steps, forward and backward included
        assert abs(phase.error) <= CASES[name][2], (name, phase)
    assert "compiled (torch.compile default" in (simulated.metadata.describer or ""), simulated.metadata


def test_compile_saves_activations_against_eager():
    """The same model and batch, eager (traced) and compiled: compile keeps fewer bytes for backward and peaks
    lower; parameters, gradients and optimizer states are the same (the optimizer step is eager in both)."""
    model = _model(GPT2)
    logs = {c: simulate(describe(model, _setup(compile=c), "cpu", all_steps=True)) for c in (False, True)}
    peaks = {}
    for c, log in logs.items():
        v = compare_logs(log, log)
        peaks[c] = (v.overall.predicted, {k: pair[1] for k, pair in v.categories_at_peak.items()})
    (eager, eager_cats), (compiled, compiled_cats) = peaks[False], peaks[True]
    assert compiled < eager
    for kept in (Category.PARAMETER.value, Category.OPTIMIZER_STATE.value):
        assert compiled_cats.get(kept) == eager_cats.get(kept)
    assert compiled_cats.get(Category.ACTIVATION.value, 0) < eager_cats.get(Category.ACTIVATION.value, 0)


def test_compiled_step_counts_the_flops_of_its_graphs():
    """A compiled graph's FLOPs are its aten ops' (torch's flop_counter formulas, as the traced describer counts
    them), on its extern GEMMs: the compiled tape carries the eager tape's matmul and attention FLOPs, forward and
    backward, so its step time is not a kernel-launch count."""
    from peakledger.models.training import build_tape

    model = _model(GPT2)
    tapes = {c: build_tape(model, _setup(compile=c), cpu=True) for c in (False, True)}
    fwd = {c: sum(op.flops for op in t.ops) for c, t in tapes.items()}
    bwd = {c: sum(n.flops for n in t.backward) for c, t in tapes.items()}
    assert fwd[True] == fwd[False] > 0 and bwd[True] == bwd[False] > 0
    assert all(op.flops == 0 for op in tapes[True].ops if op.kind == "compiled.save")


def test_checkpointing_table_offers_compile_rows():
    """`peakledger checkpointing` on a model compile is modelled for: torch.compile without and with full
    checkpointing are two more rows, each the compiled scenario's own simulation; a compiled row's recompute is what
    its step runs over compile alone (the partitioner's recompute is inside the backward graph)."""
    from peakledger.analysis.checkpointing import policy_table, render_table, simulate_run, step_flops

    scenario = Scenario(name="gpt2", model=_model(GPT2), setup=_setup(compile=False), device="cpu")
    rows = {r.label: r for r in policy_table(scenario, policies=("none", "full"))}
    assert list(rows) == ["none", "full", "compile", "compile + full", "compile + op-policy"]
    for label, ckpt in (("compile", "none"), ("compile + full", "full"), ("compile + op-policy", "op-policy")):
        run = simulate_run(scenario.with_changes(compile=True, checkpointing=ckpt))
        assert rows[label].compiled and rows[label].peak == run.peak
    alone = step_flops(simulate_run(scenario.with_changes(compile=True)).graph, 0)[0]
    full = step_flops(simulate_run(scenario.with_changes(compile=True, checkpointing="full")).graph, 0)[0]
    assert rows["compile + full"].recompute_flops == full - alone > 0 and rows["compile"].recompute_flops == 0
    assert rows["compile + full"].peak < rows["compile"].peak < rows["none"].peak
    assert rows["compile + full"].peak <= rows["compile + op-policy"].peak <= rows["compile"].peak
    assert 0 < rows["compile + op-policy"].recompute_flops < rows["compile + full"].recompute_flops
    assert "compile: torch.compile (inductor)" in render_table(list(rows.values()))
    on_gpu = Scenario(name="gpt2", model=_model(GPT2), setup=_setup(compile=False), device="H100-80GB")
    assert [r.label for r in policy_table(on_gpu, policies=("none",))] == ["none"]  # compile not modelled there


def test_a_preset_gets_compile_as_a_fix_run_as_its_hf_equivalent():
    """A hand-written preset compiles as its HF equivalent (what `--compile` builds for a preset): `explain`'s and
    `checkpointing`'s compile fix changes the model with the setup, the same simulation as the preset built
    compiled; a model without an HF equivalent (an MLP) is not offered compile."""
    from peakledger.analysis.checkpointing import compile_applies, policy_table
    from peakledger.fixes import compile_fixes
    from peakledger.scenario import build_scenario

    training = {"micro_batch": 2, "seq_len": 32, "precision": "fp32", "steps": 2}
    eager = build_scenario({"preset": "tiny-llama"}, training, {"device": "cpu"})
    assert compile_applies(eager) and [name for name, *_ in compile_fixes(eager)] == ["torch.compile (inductor)"]
    fixed = eager.with_changes(**compile_fixes(eager)[0][1])
    built = build_scenario({"preset": "tiny-llama"}, {**training, "compile": True}, {"device": "cpu"})
    assert fixed.model == built.model and fixed.model.kind == "hf"
    assert run(fixed).peaks.overall.bytes == run(built).peaks.overall.bytes
    rows = {r.label: r for r in policy_table(eager, policies=("none",))}
    assert rows["compile"].compiled and rows["compile"].peak == run(fixed).peaks.overall.bytes
    mlp = build_scenario({"preset": "tiny-mlp"}, {"micro_batch": 4, "precision": "fp32"}, {"device": "cpu"})
    assert not compile_applies(mlp) and compile_fixes(mlp) == []


def test_simulate_compile_reports_what_compile_saved_by_row(capsys):
    """simulate --compile prints the eager run beside it: its peak and each ledger row at the peak, from the same
    scenario simulated uncompiled (the eager figures here come from a separate eager simulation)."""
    argv = ["simulate", "--hf-config", str(GPT2), "--compile", "--precision", "fp32", "--micro-batch", "2",
            "--seq-len", "32", "--device", "cpu", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    saved = out["compile_vs_eager"]
    assert main([a for a in argv if a != "--compile"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert saved["eager_peak"] == eager["peak"]["bytes"] and saved["compiled_peak"] == out["peak"]["bytes"]
    assert saved["saved"] == saved["eager_peak"] - saved["compiled_peak"] > 0
    rows = {r["row"]: r for r in saved["by_row_at_peak"]}
    for row in eager["ledger"]:
        assert rows[row["row"]]["eager"] == row["bytes"]
    for row in out["ledger"]:
        assert rows[row["row"]]["compiled"] == row["bytes"]
    assert rows["activation"]["saved"] > 0 and rows["parameter"]["saved"] == 0
    # each phase's peak beside eager's, and the rows at each run's forward + backward peak (where compile acts)
    phases = {name: {(p["step"], p["phase"]): p["allocated"] for p in report["phases"]}
              for name, report in (("eager", eager), ("compiled", out))}
    assert len(saved["by_phase"]) == len(phases["compiled"])
    for row, key in zip(saved["by_phase"], phases["compiled"]):
        assert (row["eager"], row["compiled"]) == (phases["eager"][key], phases["compiled"][key])
    training = {name: max(v for (_, phase), v in p.items() if phase in ("forward", "backward"))
                for name, p in phases.items()}
    fb = saved["forward_backward_peak"]
    assert (fb["eager"], fb["compiled"]) == (training["eager"], training["compiled"])
    assert sum(r["compiled"] for r in fb["by_row"]) == fb["compiled"] < fb["eager"]
    assert sum(r["eager"] for r in fb["by_row"]) == fb["eager"]


@pytest.mark.parametrize("kw, field", [
    (dict(compile=False, compile_mode="reduce-overhead"), "compile_mode"),
    (dict(compile_mode="fancy"), "compile_mode"),
    (dict(lora_r=8, quantize="nf4"), "quantize"),
    (dict(world_size=2), "world_size"),
    (dict(checkpointing="sqrt"), "checkpointing"),
    (dict(checkpointing="selective"), "checkpointing"),
    (dict(precision="bf16-mixed"), "precision"),
    (dict(grad_accum=2), "grad_accum"),
    (dict(optimizer_offload="states"), "optimizer_offload"),
    (dict(passes="forward"), "passes"),
])
def test_what_compile_does_not_model_is_refused_by_name(kw, field):
    with pytest.raises(ConfigError) as e:
        _setup(**kw)
    assert e.value.field == field


def test_compile_refuses_presets_gpus_it_cannot_lower_and_autotuning():
    """A CUDA profile's compiled program is lowered by torch's CUDA build for the device it sees (models/compile/
    gpu.py): a CPU build of torch refuses it by name, as it refuses a device of another compute capability or a
    scenario of another torch version where it has one."""
    import torch

    with pytest.raises(ConfigError) as e:
        describe(PRESETS["tiny"], _setup(), "cpu")
    assert e.value.field == "compile" and "--hf-config" in str(e.value)
    if not torch.backends.cuda.is_built():
        with pytest.raises(ConfigError) as e:
            describe(_model(GPT2), _setup(), "H100-80GB")
        assert e.value.field == "device" and "has no CUDA" in str(e.value) and torch.__version__ in str(e.value)
        assert "allowed with compile on this install: cpu" in str(e.value)
    with pytest.raises(ConfigError) as e:
        describe(_model(GPT2), _setup(compile_mode="max-autotune-no-cudagraphs"), "cpu")
    assert e.value.field == "compile_mode"


def test_a_preset_compiles_as_its_hf_equivalent():
    """torch.compile's program is a traced model's: a preset (or any hand-written transformer config) runs as the HF
    model of its architecture (models/transformer/hf_config.py `hf_equivalent`, the transformer families' hook),
    whose config reads back to the same sizes; a config HF's classes cannot build is refused naming the field. The
    mlp family has none."""
    import dataclasses

    from peakledger.models.families import family_of
    from peakledger.models.traced.model import TracedModel
    from peakledger.models.transformer.hf_config import from_hf_config, hf_equivalent
    from peakledger.scenario import build_scenario

    for name, cfg in PRESETS.items():
        if name == "tiny-mlp":
            assert family_of(cfg).hf_equivalent is None
            continue
        assert family_of(cfg).hf_equivalent is hf_equivalent
        back = from_hf_config(hf_equivalent(cfg), name)
        assert (back.n_layer, back.d_model, back.kv_heads, back.ffn, back.tied) == \
            (cfg.n_layer, cfg.d_model, cfg.kv_heads, cfg.ffn, cfg.tied)
    scenario = build_scenario({"preset": "tiny-llama"}, {"compile": True, "precision": "fp32", "micro_batch": 2,
                                                         "seq_len": 32}, {"device": "cpu"})
    assert isinstance(scenario.model, TracedModel) and scenario.model.hf_dict() == hf_equivalent(PRESETS["tiny-llama"])
    assert run(scenario).peaks.overall.bytes > 0
    with pytest.raises(ConfigError) as e:
        hf_equivalent(dataclasses.replace(PRESETS["tiny"], bias=False))
    assert "has no HF equivalent" in str(e.value) and "has_bias" in str(e.value)


def test_zeros_for_outputs_no_gradient_reached_live_by_torch_version():
    """AOTAutograd's zeros for outputs no gradient reached: held by `CompiledFunction.backward`'s argument tuple to
    the node's end up to torch 2.12, freed at the wrapper's `del` from 2.13 (its prologue clears the list)."""
    from peakledger.models.compile.convert import zeros_held

    assert zeros_held("2.11") and zeros_held("2.12") and not zeros_held("2.13") and not zeros_held("3.0")


def test_mix_order_reduction_lines_allocate():
    """CUDA inductor's mix-order reduction ends in an eager reduce written as a text line of the wrapper: it
    allocates its fp32 result (and its cast), which no AllocateLine says (models/compile/plan.py)."""
    from peakledger.models.compile.plan import _text_line

    line = "buf12 = workspace_0[: 8 * 2048].view(8, 2048).sum(dim=0).to(torch.bfloat16)"
    assert _text_line(line) == [("alloc", "buf12.fp32", 2048 * 4, "fp32", (2048,), (1,)),
                                ("alloc", "buf12", 2048 * 2, "bf16", (2048,), (1,)), ("drop", "buf12.fp32")]
    assert _text_line("buf3 = workspace_1[: 4 * 64].view(4, 64).sum(dim=0)") == \
        [("alloc", "buf3", 64 * 4, "fp32", (64,), (1,))]
    assert _text_line("del buf3") == []


def test_compiled_tape_builds_the_model_as_the_traced_one():
    """A compiled tape knows its tied parameters (the fake model's second names of one tensor), so `build =
    device-fp32` constructs the model in the traced tape's order, the tied head made and dropped by tie_weights."""
    from peakledger.models.parallel.engine import DeviceBuild
    from peakledger.models.training import build_tape

    model = _model(GPT2)
    tapes = {c: build_tape(model, _setup(compile=c), cpu=True) for c in (False, True)}
    assert tapes[True].ties and [e.name for e in DeviceBuild(tapes[True]).ties] == [t[0] for t in tapes[True].ties]
    built = {c: [(e.kind, e.name, e.source, e.shape) for e in DeviceBuild(t).construction] for c, t in tapes.items()}
    assert built[True] == built[False]


def test_cli_refuses_on_one_line(capsys):
    code = main(["simulate", "--hf-config", str(GPT2), "--compile", "--precision", "fp32", "--device", "cpu",
                 "--world-size", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "world_size" in err and "compile" in err


@pytest.mark.parametrize("name, layouts, constants, kwargs", [
    ("aten::mm.out", (((300, 64), (64, 1), "torch.bfloat16"), ((64, 3000), (1, 64), "torch.bfloat16"),
                      ((300, 3000), (3000, 1), "torch.bfloat16")), (), ()),
    ("aten::addmm.out", (((3000,), (1,), "torch.bfloat16"), ((300, 64), (64, 1), "torch.bfloat16"),
                         ((64, 3000), (3000, 1), "torch.bfloat16"), ((300, 3000), (3000, 1), "torch.bfloat16")),
     (), (("alpha", 1), ("beta", 1))),
    ("aten::bmm.out", (((4, 300, 64), (19200, 64, 1), "torch.float32"), ((4, 64, 3000), (192000, 1, 64),
                        "torch.float32"), ((4, 300, 3000), (900000, 3000, 1), "torch.float32")), (), ()),
])
def test_a_gemm_is_measured_cut(monkeypatch, name, layouts, constants, kwargs):
    """A GEMM's own memory is measured by running it (workspace.py) with M and N cut to CUT, its inputs cut to match
    (transposed and broadcast inputs kept so): the cut call runs, and its FLOPs are the uncut GEMM's."""
    from peakledger.models.compile import workspace

    monkeypatch.setattr(workspace, "CUT", 128)
    monkeypatch.setattr(workspace, "_MEASURED", {})
    cut = workspace._cut(name, layouts)
    assert cut[-1][0][-2:] == (128, 128) and cut[-2][0][-1] == 128
    assert workspace.measure((name, layouts, constants, kwargs), 1) >= 0
    *batch, m, n = layouts[-1][0]
    assert workspace.gemm_flops((name, layouts, constants, kwargs)) == 2 * (batch or [1])[0] * m * n * 64


def test_checkpointing_dynamo_runs_eagerly_is_refused():
    """HF Llama's checkpointed forward mutates a global (the `kernels` hub layers' CompileableContextVar), so dynamo
    gives up the checkpoint higher-order op and runs the checkpointed layers eagerly between compiled graphs: refused,
    naming dynamo's reason, not simulated wrong."""
    with pytest.raises(ConfigError) as e:
        describe(_model(LLAMA), _setup(checkpointing="full"), "cpu")
    assert e.value.field == "checkpointing"
    assert "HOP: Unsafe side effect" in str(e.value) and "eagerly between compiled graphs" in str(e.value)


def test_explain_offers_compile_where_it_is_modelled():
    """A traced model on the cpu profile: explain re-simulates torch.compile as one more fix (it fits a budget
    between the compiled and the eager peak), with its compile time as its cost."""
    scenario = Scenario(name="gpt2", model=_model(GPT2), setup=_setup(compile=False), device="cpu")
    compiled = run(Scenario(name="c", model=_model(GPT2), setup=_setup(), device="cpu")).peaks.overall.bytes
    eager = run(scenario).peaks.overall.bytes
    x = diagnosis.explain(scenario, (compiled + eager) // 2)
    fix = next(f for f in x.fixes if f.changes == {"compile": True})
    assert fix.fits and fix.peak == compiled and "compiles" in fix.note and not fix.changes_training


def _lowers_cuda() -> bool:
    import torch

    return torch.backends.cuda.is_built() and torch.cuda.is_available()


@pytest.mark.skipif(not _lowers_cuda(), reason="needs a CUDA build of torch seeing a device (bench/fakecuda/run.sh "
                                                "answers for an H200 without one)")
def test_cuda_program_is_lowered_for_the_device_torch_sees():
    """On a CUDA profile the compiled program is inductor's CUDA one, lowered on fake `cuda:0` tensors: HF's
    explicit causal mask under compile sends SDPA to cuDNN attention on sm90, whose backward takes a workspace of
    4 B H T (D + 1) + 256 bytes (plan.py); the model's tied head is known to the tape. Runs where torch can lower
    CUDA (bench/fakecuda/run.sh with a CUDA build of torch: the H200 validation's environment)."""
    import torch

    from peakledger.models.training import build_tape

    cap = torch.cuda.get_device_capability(0)
    profile = next(p for p in ("H200-141GB", "H100-80GB", "A100-80GB")
                   if DEVICES[p].compute_capability == tuple(cap))
    setup = _setup(precision="bf16-autocast", micro_batch=2, seq_len=64)
    data = json.loads(LLAMA.read_text())
    model = from_hf_dict({**data, "attn_implementation": "sdpa"}, "llama-sdpa")
    tape = build_tape(model, setup, cpu=False, cuda=(DEVICES[profile].compute_capability, "2.11"))
    assert "inductor CUDA (triton)" in tape.describer
    b, h, t, d = 2, data["num_attention_heads"], 64, data["head_dim"]
    workspaces = [a for n in tape.backward for st in n.steps for a in st.allocs if a.name.endswith(".workspace")]
    if tuple(cap) == (9, 0):
        assert [w.shape for w in workspaces] == [(4 * b * h * t * (d + 1) + 256,)] * data["num_hidden_layers"]
    report = run(Scenario(name="llama", model=model, setup=setup, device=profile, torch_version="2.11"))
    assert report.gpu is not None and report.peaks.overall.bytes > 0
    with pytest.raises(ConfigError) as e:  # CUDA graphs' private pool: not modelled
        build_tape(model, _setup(compile_mode="reduce-overhead"), cpu=False,
                   cuda=(DEVICES[profile].compute_capability, "2.11"))
    assert e.value.field == "compile_mode"


def test_kernel_temporaries_are_blocks_freed_inside_their_top_level_ops_call():
    from peakledger.traces.compiled_run import _kernel_temporaries

    mm = ("aten::mm", 100, 200)
    raw = [(110, 1, 2048, mm),  # the mm's output: freed after the call returned
           (120, 2, 530432, mm), (130, 2, -530432, mm),  # freed inside the call: a temporary
           (150, 3, 64, None), (160, 3, -64, None),  # no aten op above it (a compiled region): kept
           (170, 4, 8, mm), (300, 4, -8, None),  # outlives the call
           (400, 1, -2048, None)]
    assert _kernel_temporaries(raw) == {1: "aten::mm"}
