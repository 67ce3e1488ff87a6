"""Deadline prices that mean something (issue 34): a memory budget from a real capacity (never the cpu profile's
placeholder), max-batch sweeps priced at the micro-batch they recommend, forward passes refused (what is priced is
training), no inf or nan in any output, and durations read exactly within 1 ms .. 100 years. Every expected number
is computed here from its definition (the simulation's event log, max_micro_batch, the integer ceiling), not read
back from the code under test."""

from __future__ import annotations

import csv
import inspect
import json
import math

import pytest

from peakledger import api, build_scenario, deadline
from peakledger import sweep as sweep_pkg
from peakledger.cli import main
from peakledger.deadline import DeadlineBudget, check_sweep, parse_duration, plan_point
from peakledger.models.config import ConfigError
from peakledger.models.devices import device_profile
from peakledger.sweep import DEADLINE_COLUMNS, run_sweep, to_csv, to_json
from peakledger.sweep.point import evaluate

MiB = 2**20
GPU = "H100-80GB"
TARGET = 10**9  # tokens
HOUR = DeadlineBudget(deadline_s=3600.0, target_tokens=TARGET)
# run_sweep calls deadline.check_sweep before any work (the lead wires it): the CLI refuses with exit 2
WIRED = "check_sweep" in inspect.getsource(sweep_pkg.run_sweep)
needs_wiring = pytest.mark.skipif(not WIRED, reason="run_sweep does not call deadline.check_sweep yet")


def tiny(device: str = GPU, **setup):
    return build_scenario({"preset": "tiny"}, {"seq_len": 64, "micro_batch": 1, **setup}, {"device": device})


def _rows(path) -> list[dict]:
    return list(csv.DictReader(open(path)))


def sig4(x: float) -> float:
    """`x` to 4 significant digits, as the CSV gives seconds and hours."""
    return float(f"{x:.4g}")


def _steady_step_by_hand(scenario) -> float:
    """Step 2's duration on the slowest rank: the end of its last step-2 event minus that of step 1."""
    ends: dict = {}
    for e in api.run(scenario).log.events:
        ends.setdefault(e.block.rank, {})[e.step] = e.time
    assert all(max(r) == 2 for r in ends.values())
    return max(r[2] - r[1] for r in ends.values())


def _one_line_error(capsys, field: str, *words: str) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"peakledger: error: {field}: ")
    for w in words:
        assert w in captured.err
    return captured.err


# --- 1. the memory budget is a real capacity: the cpu profile has none

def test_cpu_without_a_budget_is_refused_before_any_work():
    base = tiny("cpu")
    with pytest.raises(ConfigError) as e:
        check_sweep(base, {"micro_batch": [1, 2]}, None, HOUR)
    assert str(e.value).startswith("budget: ") and "--budget" in str(e.value) and "GPU --device" in str(e.value)
    check_sweep(base, {"micro_batch": [1, 2]}, 24 * 2**30, HOUR)  # a budget given: a real capacity
    check_sweep(base, {"micro_batch": [1]}, None, DeadlineBudget(deadline_s=3600.0, target_tokens=TARGET,
                                                                 memory_bytes=4 * MiB))  # the deadline's budget
    check_sweep(tiny(GPU), {"micro_batch": [1]}, None, HOUR)  # a GPU profile: its memory
    check_sweep(base, {"device": [GPU, "cpu"]}, None, HOUR)  # varied: checked per point
    check_sweep(base, {"micro_batch": [1]}, None, None)  # no deadline: nothing to price
    # the point itself refuses too (whether or not the sweep checked first): an error row, no price
    row = evaluate((base, {"micro_batch": 1}, None, False, HOUR))
    assert row["error"].startswith("budget: ") and row["verdict"] == deadline.INVALID
    assert all(row[c] == "" for c in DEADLINE_COLUMNS if c != "verdict") and row["budget_bytes"] == ""


@needs_wiring
def test_the_cli_refuses_cpu_without_a_budget(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["sweep", "--preset", "tiny", "--device", "cpu", "--grid", "micro_batch=1,2", "--target-tokens",
                 "1e6", "--deadline", "1h", "--output", str(out)]) == 2
    _one_line_error(capsys, "budget", "--budget", "cpu")
    assert not out.exists()


def test_a_grid_point_on_cpu_is_an_invalid_row():
    base = tiny(GPU)
    result = run_sweep(base, {"device": [GPU, "cpu"]}, jobs=1, progress=False, deadline=HOUR)
    gpu, cpu = (p.result for p in result)
    assert cpu["error"].startswith("budget: ") and "--budget" in cpu["error"] and cpu["verdict"] == deadline.INVALID
    assert cpu["deadline_rank"] == 2 and cpu["gpu_hours"] == "" and cpu["budget_bytes"] == ""
    assert gpu["error"] == "" and gpu["budget_bytes"] == device_profile(GPU).memory_bytes and gpu["deadline_rank"] == 1
    # with --budget the cpu point is priced against it
    given = DeadlineBudget(deadline_s=3600.0, target_tokens=TARGET, memory_bytes=4 * MiB)
    rows = [p.result for p in run_sweep(base, {"device": [GPU, "cpu"]}, jobs=1, progress=False, deadline=given)]
    assert [r["error"] for r in rows] == ["", ""] and [r["budget_bytes"] for r in rows] == [4 * MiB, 4 * MiB]


# --- 2. with max-batch, the price is of the micro-batch the sweep recommends

def test_max_batch_prices_the_largest_micro_batch_that_fits(tmp_path, capsys):
    budget = 600 * MiB
    best = api.max_micro_batch(tiny(), budget)
    assert best > 2  # so the grid's 1 and 2 are not what is priced
    out = tmp_path / "s.csv"
    assert main(["sweep", "--preset", "tiny", "--seq-len", "64", "--device", GPU, "--budget", "600MiB", "--grid",
                 "micro_batch=1,2", "--max-batch", "--target-tokens", "1e9", "--deadline", "1h", "--jobs", "1",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    step = _steady_step_by_hand(tiny(micro_batch=best))
    tokens = best * 64 * 1 * 1  # max micro-batch x seq_len x grad_accum x dp
    steps = -(-TARGET // tokens)
    for r, mb in zip(_rows(out), ("1", "2")):
        assert r["micro_batch"] == mb and int(r["max_micro_batch"]) == best
        assert int(r["priced_micro_batch"]) == best and int(r["tokens_per_step"]) == tokens
        assert int(r["steps_needed"]) == steps and float(r["priced_step_time_s"]) == sig4(step)
        assert float(r["wall_clock_h"]) == sig4(steps * step / 3600)
        assert float(r["gpu_hours"]) == sig4(steps * 1 * step / 3600)
        assert r["meets_deadline"] == str(steps * step <= 3600) and r["over_budget_bytes"] == "0"
    head = next(line for line in printed.splitlines() if line.startswith("rank "))
    assert head.split()[:8] == ["rank", "micro_batch", "needs", "MiB", "budget", "MiB", "priced", "mb"]


def test_max_batch_where_nothing_fits_is_priced_as_not_fitting():
    need = api.run(tiny(micro_batch=1)).capacity_needed
    budget = need - 16 * MiB
    assert api.max_micro_batch(tiny(), budget) < 1  # not even micro-batch 1 fits
    plan = DeadlineBudget(deadline_s=3600.0, target_tokens=TARGET, memory_bytes=budget)
    rows = [p.result for p in run_sweep(tiny(), {"micro_batch": [1, 2]}, max_batch=True, jobs=1, progress=False,
                                        deadline=plan)]
    step = _steady_step_by_hand(tiny(micro_batch=1))
    for r in rows:  # micro-batch 2 is priced at 1 too, and as not fitting: never as the grid's 2
        assert r["priced_micro_batch"] == 1 and r["tokens_per_step"] == 64 and r["steps_needed"] == -(-TARGET // 64)
        assert r["step_time_used_s"] == step and r["over_budget_bytes"] == need - budget
        assert not r["meets_both"] and r["verdict"].startswith("OOM by ")


def test_without_max_batch_the_points_own_micro_batch_is_priced_and_every_engine_agrees():
    plan = DeadlineBudget(deadline_s=3600.0, target_tokens=TARGET, memory_bytes=600 * MiB)
    grid = {"micro_batch": [1, 3]}
    plain = run_sweep(tiny(), grid, jobs=1, progress=False, deadline=plan)
    assert [p.result["priced_micro_batch"] for p in plain] == [1, 3]
    assert [p.result["tokens_per_step"] for p in plain] == [64, 3 * 64]
    inline = run_sweep(tiny(), grid, max_batch=True, jobs=1, progress=False, deadline=plan)
    pooled = run_sweep(tiny(), grid, max_batch=True, jobs=2, progress=False, deadline=plan)
    assert (to_csv(inline), to_json(inline, tiny(), grid, plan)) == (to_csv(pooled), to_json(pooled, tiny(), grid,
                                                                                               plan))


# --- 3. forward passes are not training steps: refused by name

def test_forward_passes_are_refused():
    base = tiny(passes="forward")
    with pytest.raises(ConfigError) as e:
        check_sweep(base, {"micro_batch": [1, 2]}, None, HOUR)
    assert str(e.value).startswith("passes: ") and "--passes forward" in str(e.value)
    check_sweep(base, {"micro_batch": [1]}, None, None)  # no deadline: a memory sweep of forward passes is fine
    row = evaluate((base, {"micro_batch": 1}, None, False, HOUR))
    assert row["error"].startswith("passes: ") and row["verdict"] == deadline.INVALID and row["steps_needed"] == ""
    rows = [p.result for p in run_sweep(tiny(), {"passes": ["train", "forward"]}, jobs=1, progress=False,
                                        deadline=HOUR)]
    assert rows[0]["error"] == "" and rows[0]["priced_micro_batch"] == 1
    assert rows[1]["error"].startswith("passes: ") and rows[1]["verdict"] == deadline.INVALID
    assert [r["deadline_rank"] for r in rows] == [1, 2]


@needs_wiring
def test_the_cli_refuses_forward_passes(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["sweep", "--preset", "tiny", "--device", GPU, "--passes", "forward", "--grid", "micro_batch=1,2",
                 "--target-steps", "1000", "--deadline", "1h", "--output", str(out)]) == 2
    _one_line_error(capsys, "passes", "--passes forward", "training")
    assert not out.exists()


# --- 4. no inf or nan in any output

def test_a_step_time_past_the_range_is_refused_not_inf(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["sweep", "--preset", "tiny", "--device", GPU, "--grid", "micro_batch=1", "--target-tokens", "1e21",
                 "--deadline", "1h", "--step-time", "1e300d", "--output", str(out)]) == 2
    _one_line_error(capsys, "step_time", "--step-time", "too large", "100 years")
    assert not out.exists()


def test_the_largest_inputs_give_finite_prices(tmp_path, capsys):
    out, js = tmp_path / "s.csv", tmp_path / "s.json"
    assert main(["sweep", "--preset", "tiny", "--seq-len", "64", "--device", GPU, "--grid", "micro_batch=1,2",
                 "--target-tokens", "1e21", "--deadline", "36525d", "--step-time", "36525d", "--output", str(out),
                 "--json-output", str(js)]) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    step = 36525 * 86400.0
    for r in rows:
        steps = -(-10**21 // (int(r["micro_batch"]) * 64))
        assert int(r["steps_needed"]) == steps and float(r["wall_clock_h"]) == sig4(steps * step / 3600)
        assert float(r["gpu_hours"]) == sig4(steps * 1 * step / 3600)
        assert float(r["late_by_h"]) == sig4((steps * step - step) / 3600)
    cells = [c for r in rows for c in r.values()] + printed.split()
    assert not [c for c in cells if c.strip().lower() in ("inf", "-inf", "nan") or "inf h" in c]
    text = js.read_text()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


@pytest.mark.parametrize("step_time", [math.inf, math.nan, 0.0, -1.0])
def test_a_cost_model_step_time_that_is_no_time_is_refused(step_time):
    with pytest.raises(ConfigError, match="^step_time: .*--step-time"):
        plan_point(HOUR, tokens=64, step_time_s=step_time, step_time_source="cost model (steady step)",
                   world_size=1, capacity_needed=0, fits=True, memory_bytes=1)


def test_a_product_past_a_float_is_refused_by_the_column():
    steps = DeadlineBudget(deadline_s=3600.0, target_steps=10**21)
    with pytest.raises(ConfigError, match="^gpu_hours: "):  # 1e21 x 1e287 x 2 s: past 1.8e308, a float's inf
        plan_point(steps, tokens=1, step_time_s=2.0, step_time_source="s", world_size=10**287, capacity_needed=0,
                   fits=True, memory_bytes=1)
    with pytest.raises(ConfigError, match="^(wall_clock_h|gpu_hours): "):  # an integer past a float: OverflowError
        plan_point(steps, tokens=1, step_time_s=2.0, step_time_source="s", world_size=10**400, capacity_needed=0,
                   fits=True, memory_bytes=1)
    for bad in (dict(deadline_s=3600.0, target_steps=1, step_time_s=1e300),
                dict(deadline_s=1e-5, target_steps=1), dict(deadline_s=1e300, target_steps=1)):
        with pytest.raises(ConfigError, match="^(step_time|deadline): .*100 years"):
            DeadlineBudget(**bad)
    with pytest.raises(ConfigError, match="^target_steps: .*1e21"):
        DeadlineBudget(deadline_s=3600.0, target_steps=10**21 + 1)


# --- 5. durations read exactly, within 1 ms .. 100 years, the message true

@pytest.mark.parametrize("field", ["deadline", "step_time"])
@pytest.mark.parametrize("text, word", [("1e-400s", "too small"), ("0.999ms", "too small"), ("1e-7h", "too small"),
                                        ("36525.000001d", "too large"), ("1e400h", "too large"),
                                        ("1e99999999999999s", "too large"), ("101e99999999999999999ms", "too large"),
                                        ("0e5s", "> 0"), ("0.000s", "> 0"), ("-1e-400s", "> 0")])
def test_durations_out_of_range_say_which_bound(field, text, word):
    with pytest.raises(ConfigError) as e:
        parse_duration(text, field)
    message = str(e.value)
    assert message.startswith(f"{field}: --{field.replace('_', '-')} ") and word in message
    assert "1ms" in message and "100 years" in message
    if word != "> 0":
        assert "> 0," not in message.split(";")[0]  # not "must be > 0" for a value that is > 0


@pytest.mark.parametrize("text, seconds", [("1ms", 0.001), ("1e-3s", 0.001), ("36525d", 3155760000.0),
                                           ("876600h", 3155760000.0), ("350ms", 0.35), ("1.1h", 3960.0),
                                           ("0.7d", 60480.0), ("0.1h", 360.0), ("1e-400s", None)])
def test_durations_are_exact(text, seconds):
    if seconds is None:
        with pytest.raises(ConfigError):
            parse_duration(text)
        return
    assert parse_duration(text) == seconds  # the exact value rounded once: 350 x 0.001 would be 0.35000000000000003


def test_the_cli_says_too_small_not_zero(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["sweep", "--preset", "tiny", "--device", GPU, "--grid", "micro_batch=1", "--target-tokens", "1e6",
                 "--deadline", "1e-400s", "--output", str(out)]) == 2
    err = _one_line_error(capsys, "deadline", "--deadline", "too small", "1ms")
    assert "must be > 0" not in err and not out.exists()
