"""Steps repeat (models/training.StepPlan): a run describes and simulates only its distinct steps, and its
report is the full simulation's, number for number: peaks, ledger, rank peaks, OOMs, event count and
step time. And the checkpointing answer is the same bytes run after run."""

from __future__ import annotations

import json
import math
import re

import pytest

from peakledger.analysis.checkpointing import run_time, step_flops, step_time
from peakledger.analysis.export import chrome_trace
from peakledger.analysis.report import report_json, summarize
from peakledger.analysis.report_text import render_text
from peakledger.cli import main
from peakledger.models import training
from peakledger.models.checkpoint_io import saves_after
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import StepPlan, describe, step_kind, step_plan
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Pool

CFG = preset("tiny")
SMALL = dict(micro_batch=1, seq_len=8)
SETUPS = {
    "plain": {},
    "accumulation": dict(grad_accum=3, precision="bf16-mixed"),
    "zero3": dict(world_size=4, zero_stage=3, precision="bf16-mixed", stage3_prefetch_bucket_size=20_000,
                  stage3_param_persistence_threshold=100),
    "fsdp2": dict(world_size=4, dp_engine="fsdp2", forward_prefetch=1, precision="bf16-mixed"),
    "zero-redundancy": dict(world_size=2, dp_engine="zero-redundancy-optimizer"),  # steps overlap in time
    "offload-chunked": dict(optimizer_offload="chunked", offload_chunk_params=20_000),
    "offload-chunked-first": dict(optimizer_offload="chunked", offload_chunk_params=20_000,
                                  offload_first_step="chunked"),
    "save-torch-save": dict(checkpoint_every=3, world_size=2, dp_engine="fsdp2"),
    "save-full-rank0": dict(checkpoint_every=2, save_mode="full-rank0", world_size=2, dp_engine="fsdp2"),
    "save-async": dict(checkpoint_every=3, save_mode="async"),
    "load-and-save": dict(load_mode="map-to-device", checkpoint_every=2, precision="bf16-mixed"),
    "offload-states-save": dict(optimizer_offload="states", checkpoint_every=4, save_mode="sharded"),
}
PLAN_KEYS = ("steps_simulated", "repeats", "events", "simulated_time_per_step_s", "phases")


PHASE_ROW = re.compile(r"  (step \d+ |load |\(steps )")  # a row of the phase table: one per simulated step


def _runs(steps: int, **setup):
    s = TrainingSetup(**{**SMALL, **setup, "steps": steps})
    return simulate(describe(CFG, s)), simulate(describe(CFG, s, all_steps=True))


def _split(data: dict) -> tuple[dict, dict]:
    return {k: v for k, v in data.items() if k not in PLAN_KEYS}, {k: data.get(k) for k in PLAN_KEYS}


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_a_truncated_run_reports_what_the_full_run_does(name):
    truncated, full = _runs(9, **SETUPS[name])
    plan = step_plan(TrainingSetup(**{**SMALL, **SETUPS[name], "steps": 9}))
    assert plan.truncated and truncated.metadata.steps_simulated == plan.simulated
    assert {e.step for e in truncated.events} == set(range(plan.simulated + 1))
    got, got_plan = _split(report_json(summarize(truncated, name=name)))
    want, want_plan = _split(report_json(summarize(full, name=name)))
    assert got == want  # every peak with its event and time, the ledger, rank peaks, host peak, events_all_steps
    assert got["events_all_steps"] == want_plan["events"] == len(full.events)
    assert got_plan["events"] == len(truncated.events) < len(full.events)
    assert math.isclose(got_plan["simulated_time_per_step_s"], want_plan["simulated_time_per_step_s"], rel_tol=1e-12)
    assert want_plan["steps_simulated"] == 9 and want_plan["repeats"] is None
    assert got_plan["repeats"]["source_steps"] == list(plan.repeated)
    # the peak of each phase: the simulated steps', the same as the full run's for those steps
    assert got_plan["phases"] == [p for p in want_plan["phases"] if p["step"] <= plan.simulated]
    # the text differs in the steps it names as simulated and the event count only
    text = lambda log: [ln for ln in render_text(summarize(log, name=name)).splitlines()  # noqa: E731
                        if "B_eff" not in ln and " events" not in ln and not PHASE_ROW.match(ln)]
    assert text(truncated) == text(full)


@pytest.mark.parametrize("setup, simulated", [
    (dict(checkpoint_every=5, save_mode="async", precision="bf16-mixed"), 12),
    (dict(checkpoint_every=5, save_mode="full-rank0", world_size=2, dp_engine="fsdp2"), 8)])
def test_peaks_at_saves_and_longer_runs_agree(setup, simulated):
    # the first save at step 5, the repeating tail after it; a run about twice as long as what is simulated
    truncated, full = _runs(23, **setup)
    assert truncated.metadata.steps_simulated == simulated
    got, want = report_json(summarize(truncated)), report_json(summarize(full))
    assert _split(got)[0] == _split(want)[0]
    if setup["save_mode"] == "full-rank0":
        assert got["peak"]["phase"] == "checkpoint" and got["peak"]["step"] == 5
    assert math.isclose(got["simulated_time_per_step_s"], want["simulated_time_per_step_s"], rel_tol=1e-12)


def test_ranks_that_repeat_at_their_own_pace_end_the_run_as_in_full():
    # sharded saves write a different share on each rank: rank 1's steps take longer, its lag grows
    s = TrainingSetup(**{**SMALL, "steps": 14, "world_size": 2, "dp_engine": "zero-redundancy-optimizer",
                         "checkpoint_every": 3, "save_mode": "sharded", "load_mode": "full-then-device"})
    truncated, full = (simulate(describe(CFG, s, "cpu", all_steps=a)) for a in (False, True))
    got, want = report_json(summarize(truncated)), report_json(summarize(full))
    assert _split(got)[0] == _split(want)[0]
    assert math.isclose(got["simulated_time_per_step_s"], want["simulated_time_per_step_s"], rel_tol=1e-12)
    graphs = [describe(CFG, s, "cpu", all_steps=a) for a in (False, True)]
    assert math.isclose(step_time(graphs[0]), step_time(graphs[1]), rel_tol=1e-12)


@pytest.mark.parametrize("stop", [True, False])
def test_an_oom_is_the_full_runs(stop):
    s = TrainingSetup(**{**SMALL, "checkpoint_every": 3, "steps": 10})
    plain = summarize(simulate(describe(CFG, s)))
    budget = plain.peaks.steady.bytes - 1  # exceeded in the first step and again at every later save
    caps = {(0, Pool.DEVICE): budget}
    truncated = simulate(describe(CFG, s), caps, stop_on_oom=stop)
    full = simulate(describe(CFG, s, all_steps=True), caps, stop_on_oom=stop)
    got, want = report_json(summarize(truncated)), report_json(summarize(full))
    assert got["ooms"] == want["ooms"] and got["ooms"]
    assert _split(got)[0] == _split(want)[0]
    if stop:  # cut at the same event: the log is the full run's, nothing repeats
        assert got["events"] == want["events"] and got["repeats"] is None
        assert got["simulated_time_per_step_s"] == want["simulated_time_per_step_s"]


def test_how_many_steps_are_simulated():
    def simulated(**setup) -> int:
        return step_plan(TrainingSetup(**{**SMALL, **setup})).simulated
    assert simulated(steps=20_000) == 4  # step 1, step 2 after it, step 3 after a steady step, step 4 after that
    assert simulated(steps=3) == 3 and simulated(steps=4) == 4
    assert simulated(steps=20_000, checkpoint_every=7) == 10  # 3 + N
    assert simulated(steps=20_000, checkpoint_every=7, save_mode="async") == 16  # 2N + 2: the first save allocates
    assert simulated(steps=20_000, checkpoint_every=1, save_mode="async") == 4
    assert simulated(steps=5, checkpoint_every=7) == 4  # no save inside the run
    assert step_plan(TrainingSetup(**{**SMALL, "steps": 20_000, "checkpoint_every": 7})).period == 7


@pytest.mark.parametrize("setup", [dict(checkpoint_every=c, save_mode=m) for c in (0, 1, 2, 3, 6)
                                   for m in ("torch-save", "async")])
def test_the_plan_covers_every_kind_of_step_in_context(setup):
    """Brute force over the kinds: every step after the simulated ones has the same (previous kind, kind) as its
    source, every one-off step comes before the repeated window, and so does the step after it."""
    s = TrainingSetup(**{**SMALL, **setup, "steps": 40})
    plan = step_plan(s)
    context = lambda t: (step_kind(s, t - 1), step_kind(s, t))  # noqa: E731
    first, last = plan.repeated
    for t in range(plan.simulated + 1, 41):
        assert context(t) == context(plan.source(t))
        assert first <= plan.source(t) <= last


def test_plan_sources_and_end_time():
    plan = StepPlan(steps=10, simulated=6, period=3)
    assert [plan.source(s) for s in range(1, 11)] == [1, 2, 3, 4, 5, 6, 4, 5, 6, 4]
    ends = {0: 1.0, 1: 3.0, 2: 4.0, 3: 6.0, 4: 7.0, 5: 8.0, 6: 9.0}  # a period takes 3.0
    assert plan.end_time(ends) == 13.0  # step 10 repeats step 4, two periods later: 7 + 2 x (9 - 6)
    assert StepPlan(steps=6, simulated=6).end_time(ends) == 9.0


def test_a_step_kind_that_misses_a_behaviour_is_caught(monkeypatch):
    # forget that the first async save allocates the stager's cache: step 6 is then checked against step 3
    monkeypatch.setattr(training, "step_kind", lambda setup, step: (step == 1, saves_after(setup, step), False))
    assert training.step_plan(TrainingSetup(**{**SMALL, "steps": 20, "checkpoint_every": 3})).simulated == 6
    with pytest.raises(RuntimeError, match="step 6 does not repeat step 3"):
        describe(CFG, TrainingSetup(**{**SMALL, "steps": 20, "checkpoint_every": 3, "save_mode": "async"}))


def test_20000_steps_describe_what_4_do():
    long, short = (describe(CFG, TrainingSetup(**{**SMALL, "steps": n})) for n in (20_000, 4))
    assert len(long) == len(short)
    assert long.metadata.steps == 20_000 and long.metadata.steps_simulated == 4


def test_json_text_and_chrome_trace_say_what_was_simulated(capsys):
    assert main(["simulate", "--preset", "tiny", "--micro-batch", "1", "--seq-len", "8", "--steps", "20000",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == data["setup"]["steps"] == 20_000 and data["steps_simulated"] == 4
    assert data["repeats"]["steps"] == [5, 20_000] and data["repeats"]["source_steps"] == [4, 4]
    assert data["events_all_steps"] > data["events"]
    log = simulate(describe(CFG, TrainingSetup(**{**SMALL, "steps": 20_000})))
    text = render_text(summarize(log))
    assert "20000 steps (steps 1-4 simulated; steps 5-20000 repeat step 4's events)" in text
    assert f"{len(log.events):,} events simulated" in text
    other = chrome_trace(log)["otherData"]
    assert other["steps"] == 20_000 and other["steps_simulated"] == 4
    assert "simulated steps only, of 20000 steps: steps 1-4 simulated" in other["note"]
    full = simulate(describe(CFG, TrainingSetup(**{**SMALL, "steps": 3})))
    assert "steps" not in chrome_trace(full)["otherData"] and "; 3 steps\n" in render_text(summarize(full))


def test_checkpointing_step_figures_are_per_requested_step():
    s = TrainingSetup(**{**SMALL, "steps": 9, "checkpointing": "full", "checkpoint_every": 3})
    truncated, full = describe(CFG, s), describe(CFG, s, all_steps=True)
    assert step_flops(truncated, 0) == step_flops(full, 0) and step_flops(full, 0)[1] > 0
    assert math.isclose(step_time(truncated), run_time(full) / 9, rel_tol=1e-12)
    assert step_time(full) == run_time(full) / 9


def test_checkpointing_json_is_the_same_bytes_twice(capsys):
    argv = ["checkpointing", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--budget", "1MiB"]
    outs = []
    for extra in (["--json"], ["--json"], [], []):
        assert main(argv + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[2] == outs[3]
    assert "seconds" not in json.loads(outs[0])["optimal"]
