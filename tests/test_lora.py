"""LoRA and QLoRA (models/lora.py, models/qlora.py): real CPU runs of peft-wrapped reference models (and
bitsandbytes 4-bit base linears) held against the simulation, the parameters against peft's own, the ledger's
frozen-base / adapter rows, and bad input exiting 2.

Every real run: 2 steps, AdamW (foreach), micro-batch 2, seq 32; the whole-run peak and every forward / backward
phase peak within 0.5%, parameters, gradients and optimizer states exact (tests/realrun.py).
"""

from __future__ import annotations

import json
import warnings

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from lora_cases import ATTENTION, LLAMA_ALL, REAL_RUNS, lora_scenario
from realrun import assert_matches_real_run

from peakledger.cli import main
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import build_tape, describe


@pytest.mark.parametrize("case", list(REAL_RUNS))
def test_real_cpu_run_matches_the_simulation(case):
    preset_name, training = REAL_RUNS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_matches_real_run(lora_scenario(preset_name, **training), tolerance=0.005)


@pytest.mark.parametrize("preset_name,training", [
    ("tiny-llama", dict(precision="bf16", lora_targets=LLAMA_ALL)),
    ("tiny-llama", dict(precision="bf16", quantize="nf4", lora_targets=ATTENTION)),
    ("tiny", dict(precision="fp32", lora_targets=("attn.c_proj", "c_fc"))),
    ("tiny", dict(precision="fp32", quantize="nf4")),
])
def test_parameters_are_peft_s_own_names_shapes_dtypes_and_trainability(preset_name, training):
    """The tape's parameters are the peft model's `named_parameters()`, in order, with their shapes, dtypes
    (fp32 adapters under pure bf16, packed uint8 weights) and requires_grad."""
    from peakledger.models.parallel import own_dtype
    from peakledger.models.training import trainable_params
    from peakledger.traces.reference import build_model
    from peakledger.traces.tracker import DTYPE_NAMES

    scenario = lora_scenario(preset_name, **training)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(scenario.model, scenario.setup)
    tape = build_tape(scenario.model, scenario.setup, cpu=True)
    trainable = trainable_params(tape, scenario.setup.optimizer.frozen)
    real = [(n, tuple(p.shape), DTYPE_NAMES[p.dtype], p.requires_grad) for n, p in model.named_parameters()]
    described = [(p.name, p.shape, own_dtype(tape, p.name) or scenario.setup.precision.param, p.name in trainable)
                 for p in tape.params]
    assert described == real
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == sum(
        p.numel for p in tape.params if p.name in trainable)


def test_qlora_parameter_count_is_the_models_not_the_packed_bytes():
    """peft's print_trainable_parameters counts a 4-bit weight's out x in weights: so does the report."""
    model = preset("llama-3-8b")
    lora = describe(model, TrainingSetup(precision="bf16", lora_r=16, lora_targets=ATTENTION, steps=1, seq_len=128))
    qlora = describe(model, TrainingSetup(precision="bf16", lora_r=16, lora_targets=ATTENTION, quantize="nf4",
                                          steps=1, seq_len=128))
    plain = describe(model, TrainingSetup(precision="bf16", steps=1, seq_len=128))
    assert lora.metadata.n_params == qlora.metadata.n_params == plain.metadata.n_params + \
        lora.metadata.n_trainable
    assert lora.metadata.n_trainable == qlora.metadata.n_trainable < plain.metadata.n_trainable


def simulate_json(capsys, *argv) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


MUST_SHOW = ["--preset", "llama-3-8b", "--lora-r", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
             "--precision", "bf16"]


@pytest.mark.parametrize("quantize", [[], ["--quantize", "nf4"]])
def test_llama_3_8b_ledger_has_frozen_base_and_adapter_rows(capsys, quantize):
    data = simulate_json(capsys, *MUST_SHOW, "--seq-len", "256", "--micro-batch", "1", *quantize)
    rows = {r["row"]: r for r in data["ledger"]}
    assert "parameter" not in rows
    adapter, base = rows["parameter.adapter"], rows["parameter.frozen_base"]
    assert adapter["dtype"] == "fp32"  # peft's autocast_adapter_dtype keeps 16-bit adapters in fp32
    assert adapter["bytes"] == 4 * data["n_trainable"]
    # the adapters alone have gradients and optimizer states, in their dtype
    assert rows["gradient"]["max_bytes"] == adapter["bytes"]
    assert rows["optimizer_state.exp_avg"]["bytes"] == rows["optimizer_state.exp_avg_sq"]["bytes"] == adapter["bytes"]
    if quantize:
        assert "int8" in base["dtype"]
    else:
        assert base["dtype"] == "bf16"


def test_qlora_frozen_base_is_the_packed_weights_and_their_state(capsys):
    """The base under nf4: the block linears at half a byte a weight plus their quantization state, the rest
    (embeddings, norms, lm_head) as before."""
    from peakledger.models import qlora
    from peakledger.models.transformer import transformer_params

    lora = {r["row"]: r for r in simulate_json(capsys, *MUST_SHOW, "--seq-len", "256", "--micro-batch", "1")["ledger"]}
    q = {r["row"]: r for r in simulate_json(capsys, *MUST_SHOW, "--seq-len", "256", "--micro-batch", "1",
                                            "--quantize", "nf4")["ledger"]}
    cfg = preset("llama-3-8b")
    linears = [p for p in transformer_params(cfg) if p.name.endswith("_proj.weight")]
    dense = sum(p.numel for p in linears) * 2
    packed = sum(spec.numel * (1 if dt == "int8" else 4)
                 for p in linears for spec, dt in qlora.packed_params(p.name, p.shape))
    assert lora["parameter.frozen_base"]["bytes"] - q["parameter.frozen_base"]["bytes"] == dense - packed
    assert packed < dense / 3


def test_toml_scenario_keys(tmp_path, capsys):
    path = tmp_path / "qlora.toml"
    path.write_text('[model]\npreset = "tiny-llama"\n[training]\nprecision = "bf16"\nlora_r = 8\nlora_alpha = 16\n'
                    'lora_targets = ["q_proj", "v_proj"]\nquantize = "nf4"\nmicro_batch = 2\nseq_len = 32\n')
    data = simulate_json(capsys, "--scenario", str(path))
    assert {"parameter.adapter", "parameter.frozen_base"} <= {r["row"] for r in data["ledger"]}
    assert data["setup"]["lora_targets"] == ["q_proj", "v_proj"] and data["setup"]["quantize"] == "nf4"


@pytest.mark.parametrize("argv,field", [
    (["--lora-r", "-1"], "lora_r"),
    (["--lora-r", "4", "--lora-targets", "q_proj,not_a_linear"], "lora_targets"),
    (["--lora-r", "4", "--lora-targets", "c_attn"], "lora_targets"),  # a GPT-2 name on a Llama
    (["--lora-r", "4", "--lora-dropout", "1.0"], "lora_dropout"),
    (["--lora-r", "4", "--lora-alpha", "0"], "lora_alpha"),
    (["--quantize", "nf4"], "quantize"),  # nothing would train
    (["--lora-r", "4", "--quantize", "int4"], "quantize"),
    (["--lora-r", "4", "--quantize", "nf4", "--precision", "bf16-mixed"], "quantize"),
    (["--lora-alpha", "16"], "lora_alpha"),  # a LoRA knob without LoRA
    (["--lora-r", "4", "--freeze", "model.*"], "frozen"),
    (["--lora-r", "4", "--world-size", "2"], "lora_r"),
    (["--lora-r", "4", "--checkpointing", "offload"], "checkpointing"),
])
def test_bad_lora_input_exits_2_naming_the_field(capsys, argv, field):
    assert main(["simulate", "--preset", "tiny-llama", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"peakledger: error: {field}: ") and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--preset", "tiny-mlp", "--lora-r", "4"],
                                  ["--preset", "tiny-mlp", "--lora-r", "4", "--quantize", "nf4", "--precision", "bf16"],
                                  ["--hf-config", "examples/hf-gpt2-tiny/config.json", "--lora-r", "4",
                                   "--describer", "hand-written"]])
def test_lora_where_it_is_not_modelled_exits_2(capsys, argv, monkeypatch):
    from pathlib import Path
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peakledger: error: lora_r: ") and "allowed" in err


def test_setup_fields_validate_like_the_others():
    with pytest.raises(ConfigError) as e:
        TrainingSetup(lora_r=True)
    assert e.value.field == "lora_r"
    with pytest.raises(ConfigError) as e:
        TrainingSetup(lora_r=4, lora_targets=("q_proj", "q_proj"))
    assert e.value.field == "lora_targets"
    with pytest.raises(ConfigError) as e:
        TrainingSetup(lora_r=4, lora_dropout=float("nan"))
    assert e.value.field == "lora_dropout"
