"""Memory and deadline together (peakledger/deadline.py, `sweep --target-tokens/--target-steps --deadline
--step-time`): the arithmetic checked by hand on the worked example and on a measured step time, the ranking,
the same bytes on every sweep engine, the self-describing CSV, and bad input refused in one line (exit 2)."""

from __future__ import annotations

import csv
import importlib.util
import io
import json

import pytest

from peakledger import api, build_scenario, deadline
from peakledger.analysis.units import format_bytes
from peakledger.cli import main
from peakledger.deadline import DeadlineBudget, parse_count, parse_duration, rank_points, steps_needed
from peakledger.models.config import ConfigError
from peakledger.models.devices import device_profile
from peakledger.sweep import DEADLINE_COLUMNS, DESCRIBE, run_sweep, to_csv, to_json

GiB = 2**30
MiB = 2**20


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


CLUSTER_ENGINES = [pytest.param("ray", marks=pytest.mark.skipif(not installed("ray"), reason="pip install ray")),
                   pytest.param("dask", marks=pytest.mark.skipif(not installed("distributed"),
                                                                 reason="pip install dask distributed"))]


def _rows(path) -> list[dict]:
    return list(csv.DictReader(open(path)))


def sig4(x: float) -> float:
    """`x` to 4 significant digits, as the CSV gives seconds and hours."""
    return float(f"{x:.4g}")


# --- the worked example: Llama-3 8B, 8 x H100-80GB, ZeRO-3, seq 4096, micro-batch x checkpointing, 2e10 tokens
# in 3.5 days, memory budget the H100-80GB profile's capacity (what the driver reports, ~79.2 GiB)

EXAMPLE = ["sweep", "--preset", "llama-3-8b", "--seq-len", "4096", "--world-size", "8", "--zero-stage", "3",
           "--device", "H100-80GB", "--grid", "micro_batch=1,2,4,8", "--grid", "checkpointing=none,full",
           "--target-tokens", "2e10", "--deadline", "3.5d", "--jobs", "1"]
# ceil(2e10 / (micro_batch x 4096 x 8)), by hand: 2e10 / 32768 = 610351.5625, / 65536 = 305175.78125,
# / 131072 = 152587.890625, / 262144 = 76293.9453125
EXAMPLE_STEPS = {1: 610352, 2: 305176, 4: 152588, 8: 76294}


def _steady_step_by_hand(scenario) -> float:
    """Step 2's duration on the slowest rank: the end of its last step-2 event minus that of step 1."""
    log = api.run(scenario).log
    ends: dict = {}
    for e in log.events:
        ends.setdefault(e.block.rank, {})[e.step] = e.time
    assert all(max(r) == 2 for r in ends.values())  # two steps, simulated in full
    return max(r[2] - r[1] for r in ends.values())


def test_worked_example_by_hand(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(EXAMPLE + ["--output", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    assert [(r["micro_batch"], r["checkpointing"]) for r in rows] == \
        [(m, c) for m in ("1", "2", "4", "8") for c in ("none", "full")]  # grid order
    cap = device_profile("H100-80GB").memory_bytes
    base = build_scenario({"preset": "llama-3-8b"}, {"seq_len": 4096, "world_size": 8, "zero_stage": 3},
                          {"device": "H100-80GB"})
    for r in rows:
        mb = int(r["micro_batch"])
        assert (r["model"], r["precision"], r["device"], r["world_size"]) == ("llama-3-8b", "bf16-mixed",
                                                                              "H100-80GB", "8")
        assert int(r["tokens_per_step"]) == mb * 4096 * 1 * 8  # micro_batch x seq_len x grad_accum x dp
        assert int(r["steps_needed"]) == EXAMPLE_STEPS[mb]
        step = _steady_step_by_hand(base.with_changes(micro_batch=mb, checkpointing=r["checkpointing"]))
        # the CSV's seconds and hours: 4 significant digits (the JSON has them unrounded)
        assert float(r["priced_step_time_s"]) == sig4(step) and r["step_time_source"] == "cost model (steady step)"
        assert float(r["priced_step_time_s"]) < float(r["mean_step_time_s"])  # the mean carries step 1's one-offs
        steps = EXAMPLE_STEPS[mb]
        assert float(r["wall_clock_h"]) == sig4(steps * step / 3600)
        assert float(r["gpu_hours"]) == sig4(steps * 8 * step / 3600)
        assert float(r["deadline_h"]) == 84.0 and int(r["budget_bytes"]) == cap
        fits = int(r["capacity_needed_bytes"]) <= cap
        assert r["fits"] == str(fits)
        on_time = steps * step <= 84 * 3600
        assert r["meets_deadline"] == str(on_time) and r["meets_both"] == str(fits and on_time)
        over = 0 if fits else int(r["capacity_needed_bytes"]) - cap
        assert int(r["over_budget_bytes"]) == over
        assert float(r["late_by_h"]) == (0.0 if on_time else sig4((steps * step - 84 * 3600) / 3600))
    by = {(r["micro_batch"], r["checkpointing"]): r for r in rows}
    # the fastest setups do not fit; with checkpointing everything fits and is late; the two that fit without
    # checkpointing meet both, the larger micro-batch the cheaper
    assert [k for k, _ in sorted(by.items(), key=lambda kv: int(kv[1]["deadline_rank"]))] == [
        ("2", "none"), ("1", "none"),  # meet both, by GPU-hours
        ("8", "full"), ("4", "full"), ("2", "full"), ("1", "full"),  # fit, late: least late first
        ("4", "none"), ("8", "none")]  # over the budget: smallest excess first
    fastest = min(rows, key=lambda r: float(r["wall_clock_h"]))
    assert (fastest["micro_batch"], fastest["checkpointing"], fastest["fits"]) == ("8", "none", "False")
    assert all(r["verdict"] == "meets both" for k, r in by.items() if k[1] == "none" and k[0] in "12")
    for k in (("4", "none"), ("8", "none")):
        assert by[k]["verdict"] == f"OOM by {format_bytes(int(by[k]['over_budget_bytes']), 'GiB')}"
    for m in "1248":
        late = float(by[(m, "full")]["late_by_h"])
        assert 19 < late < 28 and by[(m, "full")]["verdict"] == f"late by {late:,.2f} h"
    assert float(by[("2", "none")]["gpu_hours"]) < float(by[("1", "none")]["gpu_hours"])
    assert printed.splitlines()[-1].startswith("2 of 8 meet both; cheapest: micro_batch=2, checkpointing=none (")
    assert "target 20,000,000,000 tokens within 84.0 h" in printed


# --- a measured step time: every number by hand

MEASURED = ["sweep", "--preset", "tiny", "--seq-len", "64", "--device", "cpu", "--grid", "micro_batch=1,2,4,8",
            "--grid", "world_size=1,2", "--target-tokens", "1e6", "--deadline", "2h", "--step-time", "1.9s",
            "--budget", "4MiB", "--jobs", "1"]


def test_a_measured_step_time_by_hand(tmp_path, capsys):
    out, js = tmp_path / "m.csv", tmp_path / "m.json"
    assert main(MEASURED + ["--output", str(out), "--json-output", str(js)]) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    # tokens per step = micro_batch x 64 x world_size; steps = ceil(1e6 / that), by hand
    steps = {("1", "1"): 15625, ("1", "2"): 7813, ("2", "1"): 7813, ("2", "2"): 3907, ("4", "1"): 3907,
             ("4", "2"): 1954, ("8", "1"): 1954, ("8", "2"): 977}
    scenario = build_scenario({"preset": "tiny"}, {"seq_len": 64}, {"device": "cpu"})
    for r in rows:
        key = (r["micro_batch"], r["world_size"])
        n, ws = steps[key], int(r["world_size"])
        assert int(r["tokens_per_step"]) == int(r["micro_batch"]) * 64 * ws and int(r["steps_needed"]) == n
        assert float(r["priced_step_time_s"]) == 1.9 and r["step_time_source"] == "measured (--step-time, every point)"
        assert float(r["wall_clock_h"]) == sig4(n * 1.9 / 3600) and float(r["gpu_hours"]) == sig4(n * ws * 1.9 / 3600)
        assert r["meets_deadline"] == str(n * 1.9 <= 7200)  # 2 h: at most 3789 steps of 1.9 s
        cap = api.run(scenario.with_changes(micro_batch=int(r["micro_batch"]), world_size=ws)).capacity_needed
        assert int(r["capacity_needed_bytes"]) == cap and r["fits"] == str(cap <= 4 * MiB)
    order = [(r["micro_batch"], r["world_size"]) for r in sorted(rows, key=lambda r: int(r["deadline_rank"]))]
    assert order == [("4", "2"),  # the one that meets both: 1954 steps, 1.03 h, 2.06 GPU-hours
                     ("4", "1"), ("2", "2"),  # 3907 steps: late by 0.062 h each, 2.06 then 4.12 GPU-hours
                     ("2", "1"), ("1", "2"),  # 7813 steps: late by 2.12 h, 4.12 then 8.25 GPU-hours
                     ("1", "1"),  # 15625 steps: late by 6.25 h
                     ("8", "1"), ("8", "2")]  # micro-batch 8 needs 5.3 MiB: over by the same bytes, equal GPU-hours
    by = {(r["micro_batch"], r["world_size"]): r for r in rows}
    assert by[("4", "1")]["verdict"] == "late by 3.72 min"  # (3907 x 1.9 - 7200) s = 223.3 s = 3.7217 min
    assert by[("1", "1")]["verdict"] == "late by 6.25 h"  # (15625 x 1.9 - 7200) / 3600 = 6.2465...
    data = json.loads(js.read_text())
    assert data["deadline"] == {"target_tokens": 1000000, "target_steps": None, "deadline_s": 7200.0,
                                "deadline_h": 2.0, "step_time_s": 1.9, "memory_budget_bytes": 4 * MiB}
    assert [p["deadline_rank"] for p in data["points"]] == [int(r["deadline_rank"]) for r in rows]
    assert "1 of 8 meets both; cheapest: micro_batch=4, world_size=2 (2.06 GPU-hours, 1.03 h)" in printed


def test_target_steps_takes_the_steps_as_given(tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert main(["sweep", "--preset", "tiny", "--seq-len", "16", "--device", "cpu", "--budget", "24GiB", "--grid",
                 "micro_batch=1,2", "--target-steps", "1000", "--deadline", "90s", "--step-time", "100ms", "--output",
                 str(out)]) == 0
    rows = _rows(out)
    assert [r["steps_needed"] for r in rows] == ["1000", "1000"] and [r["target_tokens"] for r in rows] == ["", ""]
    assert all(float(r["wall_clock_h"]) == sig4(1000 * 0.1 / 3600) and r["verdict"] == "late by 10 s" for r in rows)
    assert all(int(r["budget_bytes"]) == 24 * GiB for r in rows)  # (the cpu profile has no capacity: --budget)


# --- every engine: the same rows, the same ranking, the same bytes

GRID = {"micro_batch": [1, 2, 3, 4], "seq_len": [16, 64, 128], "zero_stage": [0, 3]}  # 128 > the model's 64
BUDGET = DeadlineBudget(deadline_s=120.0, target_tokens=10**7, memory_bytes=3 * MiB)


@pytest.fixture(scope="module")
def base():
    return build_scenario({"preset": "tiny"}, {"steps": 2, "world_size": 2}, {"device": "cpu"})


@pytest.fixture(scope="module")
def inline(base):
    result = run_sweep(base, GRID, jobs=1, progress=False, deadline=BUDGET)
    return result, to_csv(result), to_json(result, base, GRID, BUDGET)


def test_the_inline_sweep_has_every_verdict(inline):
    result = inline[0]
    verdicts = [p.result["verdict"] for p in result]
    assert "meets both" in verdicts and deadline.INVALID in verdicts
    assert any(v.startswith("late by") for v in verdicts) and any(v.startswith("OOM by") for v in verdicts)
    assert any(v.startswith("OOM by") and "; late by" in v for v in verdicts)
    ranks = [p.result["deadline_rank"] for p in result]
    assert sorted(ranks) == list(range(1, len(result) + 1))
    assert ranks == [rank_points([p.result for p in result]).index(i) + 1 for i in range(len(result))]
    # the cost model's step time, per point: each point's steady step, so its own
    assert len({p.result["step_time_used_s"] for p in result if not p.result["error"]}) > 1


def test_the_local_pool_gives_the_inline_bytes(base, inline):
    result = run_sweep(base, GRID, jobs=2, progress=False, deadline=BUDGET)
    assert (to_csv(result), to_json(result, base, GRID, BUDGET)) == inline[1:]


@pytest.mark.parametrize("engine", CLUSTER_ENGINES)
def test_a_cluster_engine_gives_the_inline_bytes(engine, base, inline):
    result = run_sweep(base, GRID, jobs=2, progress=False, engine=engine, deadline=BUDGET)
    assert (to_csv(result), to_json(result, base, GRID, BUDGET)) == inline[1:]


def test_the_cli_writes_the_same_bytes_twice(tmp_path, capsys):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    assert main(MEASURED + ["--output", str(a)]) == 0
    assert main([x if x != "1" else "2" for x in MEASURED] + ["--output", str(b)]) == 0  # --jobs 2
    assert a.read_bytes() == b.read_bytes()


# --- the CSV describes itself

def test_the_csv_names_model_precision_device_and_units(base):
    plain = run_sweep(base, {"micro_batch": [1, 2]}, jobs=1, progress=False, budget=3 * MiB)
    header = next(csv.reader(io.StringIO(to_csv(plain))))
    assert header[:1 + len(DESCRIBE)] == ["micro_batch", "model", "precision", "device", "world_size"]
    assert {"peak_bytes", "capacity_needed_bytes", "mean_step_time_s", "budget_bytes", "fits"} <= set(header)
    assert not set(DEADLINE_COLUMNS) & set(header)  # no deadline, no deadline columns
    varied = run_sweep(base, {"precision": ["fp32", "bf16-mixed"], "device": ["cpu"]}, jobs=1, progress=False,
                       deadline=BUDGET)
    header = next(csv.reader(io.StringIO(to_csv(varied))))
    assert header.count("precision") == 1 and header.count("device") == 1  # the grid's own column, once
    assert header[:4] == ["precision", "device", "model", "world_size"]
    # the JSON's result keys, but the step time priced named for what it is
    assert header[-len(DEADLINE_COLUMNS):] == [{"step_time_used_s": "priced_step_time_s"}.get(c, c)
                                               for c in DEADLINE_COLUMNS]
    assert {"priced_step_time_s", "wall_clock_h", "gpu_hours", "late_by_h", "over_budget_bytes"} <= set(header)
    assert "step_time_s" not in header and "step_time_used_s" not in header


# --- the arithmetic and the inputs

def test_steps_round_up_and_the_ranking_orders_by_kind():
    budget = DeadlineBudget(deadline_s=3600.0, target_tokens=10)
    assert [steps_needed(budget, t) for t in (1, 3, 5, 10, 11)] == [10, 4, 2, 1, 1]
    assert steps_needed(DeadlineBudget(deadline_s=1.0, target_steps=7), 10**9) == 7
    rows = [{"error": "x", "verdict": deadline.INVALID},
            {"error": "", "meets_both": False, "over_budget_bytes": 5, "late_by_h": 0.0, "gpu_hours": 1.0},
            {"error": "", "meets_both": False, "over_budget_bytes": 0, "late_by_h": 2.0, "gpu_hours": 1.0},
            {"error": "", "meets_both": True, "over_budget_bytes": 0, "late_by_h": 0.0, "gpu_hours": 9.0,
             "wall_clock_h": 1.0},
            {"error": "", "meets_both": False, "over_budget_bytes": 0, "late_by_h": 1.0, "gpu_hours": 5.0},
            {"error": "", "meets_both": True, "over_budget_bytes": 0, "late_by_h": 0.0, "gpu_hours": 3.0,
             "wall_clock_h": 2.0},
            {"error": "", "meets_both": False, "over_budget_bytes": 2, "late_by_h": 3.0, "gpu_hours": 1.0}]
    for r in rows[1:]:
        r["verdict"] = "x"
    assert rank_points(rows) == [5, 3, 4, 2, 6, 1, 0]
    plan = deadline.plan_point(budget, tokens=3, step_time_s=2.0, step_time_source="s", world_size=4,
                               capacity_needed=10 * GiB + GiB // 2, fits=False, memory_bytes=10 * GiB)
    assert (plan["steps_needed"], plan["wall_clock_h"], plan["gpu_hours"]) == (4, 8 / 3600, 32 / 3600)
    assert plan["verdict"] == "OOM by 0.5 GiB" and plan["over_budget_bytes"] == GiB // 2
    late = deadline.plan_point(DeadlineBudget(deadline_s=3600.0, target_steps=5400), tokens=1, step_time_s=1.0,
                               step_time_source="s", world_size=1, capacity_needed=0, fits=True, memory_bytes=1)
    assert late["verdict"] == "late by 30 min" and late["late_by_h"] == 0.5 and not late["meets_both"]


@pytest.mark.parametrize("text, seconds", [("48h", 172800.0), ("1.9s", 1.9), ("90m", 5400.0), ("2d", 172800.0),
                                           ("350ms", 0.35), (" 1.5h ", 5400.0), ("1e3s", 1000.0), (".5h", 1800.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-15)


@pytest.mark.parametrize("text, value", [("2e9", 2 * 10**9), ("2000000000", 2 * 10**9), ("2.5e9", 25 * 10**8),
                                         ("2B", 2 * 10**9), ("500M", 5 * 10**8), ("1.5k", 1500), ("1e21", 10**21),
                                         (7, 7)])
def test_counts(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["48", "48x", "h", "-1h", "0s", "1e400h", "nan", "inf h", "", "4 8h", True, 3])
def test_bad_durations_name_the_flag_and_the_forms(text):
    with pytest.raises(ConfigError) as e:
        parse_duration(text, "deadline")
    assert str(e.value).startswith("deadline: --deadline ") and "48h" in str(e.value)


@pytest.mark.parametrize("text", ["0", "-5", "2.5", "1e22", "2e-3", "2X", "", "1e99999", "two", True, 0, 1.5])
def test_bad_counts_name_the_flag_and_the_forms(text):
    with pytest.raises(ConfigError) as e:
        parse_count(text, "target_tokens")
    assert str(e.value).startswith("target_tokens: --target-tokens ") and "2e9" in str(e.value)


BAD_CLI = [
    (["--target-tokens", "2e9", "--deadline", "48"], "deadline", "--deadline", ["no unit", "48h"]),
    (["--target-tokens", "2e9", "--deadline=-48h"], "deadline", "--deadline", ["> 0", "48h"]),
    (["--target-tokens", "2e9", "--deadline", "-2"], "deadline", "--deadline", ["no unit", "48h"]),
    (["--target-tokens", "2e9", "--deadline", "0h"], "deadline", "--deadline", ["> 0", "48h"]),
    (["--target-tokens", "2e9", "--deadline", "48 hours"], "deadline", "--deadline", ["48h"]),
    (["--target-tokens", "0", "--deadline", "48h"], "target_tokens", "--target-tokens", ["> 0", "2e9"]),
    (["--target-tokens", "-5", "--deadline", "48h"], "target_tokens", "--target-tokens", ["> 0", "2e9"]),
    (["--target-tokens", "2.5", "--deadline", "48h"], "target_tokens", "--target-tokens", ["whole", "2e9"]),
    (["--target-steps", "0", "--deadline", "48h"], "target_steps", "--target-steps", ["> 0", "2e9"]),
    (["--target-tokens", "2e9", "--target-steps", "10", "--deadline", "48h"], "target_tokens", "--target-tokens",
     ["not both", "--target-steps"]),
    (["--deadline", "48h"], "target_tokens", "--target-tokens", ["--target-steps", "2e9"]),
    (["--target-tokens", "2e9"], "deadline", "--deadline", ["48h"]),
    (["--target-tokens", "2e9", "--deadline", "48h", "--step-time", "1.9"], "step_time", "--step-time",
     ["no unit", "1.9s"]),
    (["--step-time", "1.9s"], "deadline", "--deadline", ["--step-time", "48h"]),
]


@pytest.mark.parametrize("flags, field, flag, words", BAD_CLI)
def test_bad_deadline_input_exits_2_in_one_line(tmp_path, capsys, flags, field, flag, words):
    out = tmp_path / "s.csv"
    assert main(["sweep", "--preset", "tiny", "--grid", "micro_batch=1", "--output", str(out)] + flags) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"peakledger: error: {field}: ") and flag in captured.err
    for w in words:
        assert w in captured.err
    assert not out.exists()


def test_the_budget_refuses_what_the_flags_would():
    with pytest.raises(ConfigError, match="^target_tokens: "):
        DeadlineBudget(deadline_s=1.0)
    with pytest.raises(ConfigError, match="^deadline: "):
        DeadlineBudget(deadline_s=float("nan"), target_steps=1)
    with pytest.raises(ConfigError, match="^step_time: "):
        DeadlineBudget(deadline_s=1.0, target_steps=1, step_time_s=0)
    with pytest.raises(ConfigError, match="^budget: "):
        DeadlineBudget(deadline_s=1.0, target_steps=1, memory_bytes=0)
    with pytest.raises(ConfigError, match="^budget: two memory budgets"):
        run_sweep(build_scenario({"preset": "tiny"}), {"micro_batch": [1]}, budget=1, progress=False,
                  deadline=DeadlineBudget(deadline_s=1.0, target_steps=1, memory_bytes=2))
