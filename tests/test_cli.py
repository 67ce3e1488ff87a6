"""The command line: the default scenario, JSON contract, budgets, and bad input exiting 2."""

import json

import pytest

from peakledger.cli import main

TINY = ["--preset", "tiny", "--micro-batch", "2", "--seq-len", "16"]


def _tiny_but(*argv: str) -> list[str]:
    """TINY without the flags `argv` gives (a flag given twice is refused)."""
    out = []
    for flag, value in zip(TINY[::2], TINY[1::2]):
        if flag not in argv:
            out += [flag, value]
    return out


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_json_contract(capsys):
    code, out, _ = run_cli(capsys, "simulate", *TINY, "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("ledger", "peak", "steady_peak", "first_step_peak", "events"):
        assert key in data
    assert set(data["peak"]) >= {"bytes", "op", "phase", "step"}
    assert all(set(r) >= {"row", "bytes", "dtype", "shard_factor"} for r in data["ledger"])
    assert sum(r["bytes"] for r in data["ledger"]) == data["peak"]["bytes"]
    assert data["peak"]["bytes"] >= data["steady_peak"]["bytes"]


def test_same_input_same_output_byte_for_byte(capsys):
    first = run_cli(capsys, "simulate", *TINY, "--json")[1]
    second = run_cli(capsys, "simulate", *TINY, "--json")[1]
    assert first == second


def test_text_report_labels_units(capsys):
    code, out, _ = run_cli(capsys, "simulate", *TINY, "--unit", "GB")
    assert code == 0 and " GB" in out and "true peak" in out and "steady peak" in out


def test_scenario_file_and_flag_override(tmp_path, capsys):
    f = tmp_path / "s.toml"
    f.write_text('name = "mine"\n[model]\npreset = "tiny"\n[training]\nmicro_batch = 2\nseq_len = 16\n'
                 '[run]\ndevice = "A100-80GB"\nheadroom = 0.25\n')
    data = json.loads(run_cli(capsys, "simulate", "--scenario", str(f), "--json")[1])
    assert data["scenario"] == "mine" and data["device"] == "A100-80GB"
    assert data["capacity_needed"] == -(-data["device_total_peak"]["bytes"] * 5 // 4)  # a GPU: the device total
    data2 = json.loads(run_cli(capsys, "simulate", "--scenario", str(f), "--micro-batch", "4", "--json")[1])
    assert data2["setup"]["micro_batch"] == 4


def test_json_names_the_micro_batch_size_and_the_index_apart(capsys):
    """Schema version 2: `setup.micro_batch` is a size, `peak.micro_batch_index` a place in gradient accumulation."""
    argv = [*_tiny_but("--micro-batch"), "--micro-batch", "3", "--grad-accum", "2", "--json"]
    data = json.loads(run_cli(capsys, "simulate", *argv)[1])
    assert data["version"] == 2 and data["setup"]["micro_batch"] == 3
    assert data["peak"]["micro_batch_index"] in (-1, 0, 1) and "micro_batch" not in data["peak"]  # -1: the step


def test_max_batch_cli_agrees_with_simulating_the_answer(capsys):
    # on a GPU profile a budget holds the device total: the CUDA context, the allocator's reservations
    one = json.loads(run_cli(capsys, "simulate", *TINY[:2], "--seq-len", "16", "--micro-batch", "1", "--json")[1])
    budget = one["capacity_needed"] + 4 * 2**20
    code, out, _ = run_cli(capsys, "max-batch", *TINY, "--budget", str(budget), "--json")
    best = json.loads(out)["max_micro_batch"]
    assert best >= 1

    def ooms(mb: int) -> list:
        return json.loads(run_cli(capsys, "simulate", *TINY[:2], "--seq-len", "16", "--micro-batch", str(mb),
                                  "--budget", str(budget), "--json")[1])["ooms"]
    assert ooms(best) == [] and ooms(best + 1) and "CUDA out of memory" in ooms(best + 1)[0]["message"]
    assert json.loads(run_cli(capsys, "max-batch", *TINY, "--budget", "1KB", "--json")[1])["max_micro_batch"] == -1


def test_compare_prints_cases_side_by_side(capsys):
    code, out, _ = run_cli(capsys, "compare", *TINY)
    assert code == 0 and "fp32-sgd" in out and "zero2-x8" in out and "optimizer_state.exp_avg" in out


@pytest.mark.parametrize("argv, field", [
    (["--micro-batch", "0"], "micro_batch"),
    (["--micro-batch", "-3"], "micro_batch"),
    (["--n-head", "5"], "n_head"),
    (["--precision", "fp8"], "precision"),
    (["--optimizer", "lion"], "optimizer"),
    (["--world-size", "0"], "world_size"),
    (["--zero-stage", "4"], "zero_stage"),
    (["--device", "TPU"], "device"),
    (["--seq-len", "100000"], "seq_len"),
    (["--freeze", "nothing.*"], "frozen"),
    (["--optimizer-offload", "cpu"], "optimizer_offload"),
    (["--optimizer-offload", "chunked", "--optimizer", "sgd"], "optimizer_offload"),
    (["--offload-first-step", "chunked"], "offload_first_step"),
])
def test_bad_input_exits_2_naming_the_field(capsys, argv, field):
    code, out, err = run_cli(capsys, "simulate", *_tiny_but(*argv), *argv)
    assert code == 2 and field in err and "Traceback" not in err


def test_bad_preset_toml_and_budget(tmp_path, capsys):
    code, _, err = run_cli(capsys, "simulate", "--preset", "gpt5")
    assert code == 2 and "preset" in err and "gpt2" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npreset = ")
    code, _, err = run_cli(capsys, "simulate", "--scenario", str(bad))
    assert code == 2 and "scenario" in err
    code, _, err = run_cli(capsys, "max-batch", *TINY, "--budget", "80XB")
    assert code == 2 and "budget" in err
    unknown = tmp_path / "u.toml"
    unknown.write_text("[training]\nmicro_bach = 3\n")
    code, _, err = run_cli(capsys, "simulate", "--scenario", str(unknown))
    assert code == 2 and "micro_bach" in err and "micro_batch" in err


def test_unknown_dtype_names_the_field():
    from peakledger.models.config import ConfigError, dtype_name
    with pytest.raises(ConfigError) as e:
        dtype_name("fp8", "grad_dtype")
    assert e.value.field == "grad_dtype" and "bf16" in str(e.value)


def test_plot_is_written(tmp_path, capsys):
    path = tmp_path / "t.png"
    assert run_cli(capsys, "simulate", *TINY, "--plot", str(path))[0] == 0
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_exports_from_the_cli(tmp_path, capsys):
    snap, chrome = tmp_path / "s.pickle", tmp_path / "c.json"
    assert run_cli(capsys, "simulate", *TINY, "--export-snapshot", str(snap), "--export-chrome", str(chrome))[0] == 0
    assert snap.stat().st_size > 0 and chrome.stat().st_size > 0


def test_validate_default_tiny_gpt_passes_at_one_percent(capsys):
    code, out, err = run_cli(capsys, "validate", "--tolerance", "0.01", "--json")
    data = json.loads(out)
    assert code == 0 and "within" in err
    assert data["peak"]["measured"] > 0 and abs(data["peak"]["error"]) <= 0.01
    assert set(data["phases"]) >= {"forward step 1", "backward step 1", "optimizer step 1", "forward step 2"}


def test_validate_names_the_tensor_behind_a_gap_and_fails_a_tight_tolerance(capsys):
    # the gap: the loss's 4-byte root gradient at the backward peak, which the MLP's tape does not write
    code, out, err = run_cli(capsys, "validate", "--preset", "tiny-mlp", "--micro-batch", "64", "--precision", "fp32",
                             "--optimizer-impl", "fused", "--tolerance", "0.0000001", "--json")
    data = json.loads(out)
    assert code == 1 and "OUTSIDE" in err
    gap = data["peak"]["predicted"] - data["peak"]["measured"]
    assert gap != 0 and any(u["side"] == "measured only" and u["bytes"] >= abs(gap) // 2 for u in data["unexplained"])


def test_validate_refuses_what_it_cannot_run(capsys):
    code, _, err = run_cli(capsys, "validate", "--precision", "bf16-mixed")
    assert code == 2 and "precision" in err


def test_cuda_capture_without_a_gpu_names_the_field(capsys):
    assert main(["capture", "--device-kind", "cuda", "--output", "unused.json"]) == 2
    assert "device_kind" in capsys.readouterr().err
