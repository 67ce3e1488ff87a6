"""OOM explain (simulated and measured) and sweeps."""

from __future__ import annotations

import csv
import json

from peakledger import api, diagnosis
from peakledger.analysis.explain import first_oom, peak_moment
from peakledger.cli import main
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Phase, Pool
from peakledger.traces.store import load_log


def _first_step_scenario():
    return build_scenario({"preset": "tiny"}, {"micro_batch": 1, "seq_len": 16, "precision": "fp32"},
                          {"device": "cpu"})


def test_oom_at_the_first_optimizer_step_names_the_lazily_created_state():
    scenario = _first_step_scenario()
    report = api.run(scenario)
    states_created = next(i for i, e in enumerate(report.log.events) if e.op == "optimizer.init_state")
    running = highest = 0
    for e in report.log.events[:states_created]:
        running += e.delta
        highest = max(highest, running)
    budget = highest  # everything before the states fits; the states need more
    states = sum(e.block.nbytes for e in report.log.events if e.op == "optimizer.init_state")
    assert running + states > budget
    x = diagnosis.explain(scenario, budget)
    assert x.moment.failed and x.moment.event.phase is Phase.OPTIMIZER and x.moment.event.step == 1
    assert x.moment.event.op == "optimizer.init_state"
    assert x.moment.live_bytes + x.moment.event.block.nbytes > budget >= x.moment.live_bytes
    assert any(f.fits for f in x.fixes) and x.fixes[0].fits
    for f in x.fixes:  # every fix was re-simulated: its peak is that of the changed scenario
        assert f.peak == api.run(scenario.with_changes(**f.changes)).peaks.overall.bytes
    base = api.run(scenario)
    # only fixes that change the run are listed: activation checkpointing does not touch the optimizer step
    assert all(f.fits or f.peak < base.peaks.overall.bytes for f in x.fixes)
    assert not any(f.name.startswith("checkpointing=") for f in x.fixes) and x.tried > len(x.fixes)
    assert x.where == "step 1's optimizer step (adamw, foreach), rank 0"
    assert any(line.startswith("lazy optimizer states") for line in x.first_step)


def test_explain_cli_names_phase_op_tensor_and_fixes(capsys):
    assert main(["explain", "--preset", "tiny", "--micro-batch", "1", "--seq-len", "16", "--precision", "fp32",
                 "--device", "cpu", "--budget", "1000000B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    m = out["moment"]
    assert m["failed"] and m["op"] and m["phase"] and m["tensor"] and m["heavy"] in ("state-heavy", "activation-heavy")
    assert m["live_bytes"] + m["tensor_bytes"] > out["budget"]
    assert out["fixes"] and all("peak" in f and "cost" in f for f in out["fixes"])


def test_explain_a_measured_trace_replays_it_against_the_budget(capsys):
    path = "traces/data/tiny-gpt2-eager-fp32-adamw.json"
    log = load_log(path)
    peak = peak_moment(log).live_bytes
    assert first_oom(log, peak) is None and first_oom(log, peak - 1) is not None
    assert main(["explain", "--trace", path, "--budget", f"{peak - 1}B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["moment"]["failed"] and out["moment"]["live_bytes"] + out["moment"]["tensor_bytes"] > peak - 1


def test_sweep_writes_csv_and_json_in_grid_order_with_errors_as_rows(tmp_path, capsys):
    csv_path, json_path = tmp_path / "s.csv", tmp_path / "s.json"
    args = ["sweep", "--preset", "tiny", "--seq-len", "16", "--grid", "micro_batch=1,2", "--grid",
            "zero_stage=0,3", "--grid", "dp_engine=deepspeed,fsdp2", "--world-size", "2", "--budget", "1GiB",
            "--jobs", "2", "--output", str(csv_path), "--json-output", str(json_path)]
    assert main(args) == 0
    rows = list(csv.DictReader(csv_path.open()))
    assert [(r["micro_batch"], r["zero_stage"], r["dp_engine"]) for r in rows][:3] == \
        [("1", "0", "deepspeed"), ("1", "0", "fsdp2"), ("1", "3", "deepspeed")]
    bad = [r for r in rows if r["error"]]
    assert bad and all(r["zero_stage"] == "3" and r["dp_engine"] == "fsdp2" for r in bad)
    good = [r for r in rows if not r["error"]]
    scenario = build_scenario({"preset": "tiny"}, {"seq_len": 16, "world_size": 2})
    for r in good:
        expected = api.run(scenario.with_changes(micro_batch=int(r["micro_batch"]), zero_stage=int(r["zero_stage"]),
                                                 dp_engine=r["dp_engine"]))
        assert int(r["peak_bytes"]) == expected.peaks.overall.bytes
    first = json_path.read_bytes()
    at = args.index("--jobs")
    assert main([*args[:at], "--jobs", "1", *args[at + 2:]]) == 0  # (a flag is given once)
    assert json_path.read_bytes() == first  # same grid, same bytes, whatever the parallelism


def test_sweep_refuses_a_misspelt_field(tmp_path, capsys):
    assert main(["sweep", "--preset", "tiny", "--grid", "micro_bach=1,2", "--output", str(tmp_path / "s.csv")]) == 2
    assert "micro_bach" in capsys.readouterr().err and not (tmp_path / "s.csv").exists()


def test_explain_checks_the_host_pool_with_a_host_budget():
    scenario = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, "checkpoint_every": 1,
                                                   "save_mode": "async"})
    host = peak_moment(api.run(scenario).log, pool=Pool.HOST).live_bytes
    assert host > 0
    x = diagnosis.explain(scenario, budget=1 << 40, host_budget=host - 1)
    assert x.host_moment is not None and x.host_moment.failed and x.host_moment.pool is Pool.HOST
    assert x.host_moment.live_bytes + x.host_moment.event.block.nbytes > host - 1
    assert not x.moment.failed  # the device budget is ample


def test_the_binding_constraint_is_named_where_no_activation_fix_reaches(capsys):
    """Issue 37: gpt2-medium at 5 GiB runs out in the forward, but what binds is step 1's optimizer step (the
    states and the update's temporaries, no activations live): the label names it, and the activation fixes,
    simulated on their own, still do not fit, running out in the optimizer step."""
    args = ["--preset", "gpt2-medium", "--budget", "5GiB"]
    assert main(["explain", *args, "--json"]) == 0
    moment = json.loads(capsys.readouterr().out)["moment"]
    assert moment["phase"] == "forward" and moment["binding"]["phase"] == "optimizer"
    assert moment["binding"]["step"] == 1 and moment["binding"]["bytes"] > 5 << 30
    main(["explain", *args])
    assert "state-bound: step 1 optimizer step needs" in capsys.readouterr().out
    assert main(["simulate", *args, "--checkpointing", "full", "--micro-batch", "1", "--json"]) == 0
    ooms = json.loads(capsys.readouterr().out)["ooms"]
    assert ooms and ooms[0]["phase"] == "optimizer"
    assert main(["explain", "--preset", "gpt2", "--budget", "4GiB", "--json"]) == 0  # the forward binds: no label
    assert json.loads(capsys.readouterr().out)["moment"]["binding"] is None
