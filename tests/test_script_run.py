"""`peakledger run SCRIPT.py`: the user's own script predicted on fake tensors, held against its real CPU run.

The measured side is the script run for real under the allocation tracker in a fresh process
(traces/script_run.py); the prediction is the same script on fake tensors, recorded and simulated. They are two
runs of the user's program, one with memory and one without: equal peaks mean the fake run is the real one.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from peakledger.cli import main
from peakledger.script import ScriptRun, predict_script, validate_script
from peakledger.simulator.events import Phase

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "examples" / "scripts"
PLAIN = str(SCRIPTS / "plain_loop.py")


def _has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _exact(run: ScriptRun) -> None:
    report, _ = predict_script(run)
    (v,) = validate_script(run, report)
    assert v.overall.measured > 0
    assert v.overall.predicted == v.overall.measured
    for p in v.phases:
        assert p.predicted == p.measured, p.label


@pytest.mark.parametrize("loop", ["held", "dropped"])
def test_plain_loop_is_exact_and_the_loop_changes_the_peak(loop):
    _exact(ScriptRun(PLAIN, ("--loop", loop)))


def test_the_two_loops_differ_by_the_outputs_held_and_the_report_names_the_loop(capsys):
    held, _ = predict_script(ScriptRun(PLAIN, ("--loop", "held")))
    dropped, _ = predict_script(ScriptRun(PLAIN, ("--loop", "dropped")))
    assert held.peaks.overall.bytes > dropped.peaks.overall.bytes
    assert held.metadata.script["calls"]["outputs_held"] == 2
    assert dropped.metadata.script["calls"]["outputs_held"] == 0
    assert main(["run", PLAIN, "--", "--loop", "dropped"]) == 0
    assert "outputs dropped before backward, as HF Trainer's compute_loss drops them" in capsys.readouterr().out


def test_the_step_structure_is_discovered():
    report, _ = predict_script(ScriptRun(PLAIN, ("--loop", "dropped", "--grad-accum", "4"), steps=3))
    calls = report.metadata.script["calls"]
    assert calls["optimizer_steps"] == 3 and calls["micro_batches"] == [4, 4, 4]
    assert {e.micro_batch_index for e in report.log.events if e.phase is Phase.BACKWARD} == {0, 1, 2, 3}
    # the run stops at the next training forward: never a fourth step
    assert max(e.step for e in report.log.events) == 3


@pytest.mark.skipif(not _has("datasets"), reason="needs datasets (pip install datasets)")
def test_hf_trainer_with_eval_is_exact():
    run = ScriptRun(str(SCRIPTS / "hf_trainer_clm.py"), ("--save",))
    report, _ = predict_script(run)
    assert any(e.phase is Phase.EVAL for e in report.log.events)
    _exact(run)


def test_accelerate_loop_is_exact():
    _exact(ScriptRun(str(SCRIPTS / "accelerate_loop.py")))


@pytest.mark.skipif(not _has("trl", "datasets"), reason="needs trl and datasets")
def test_trl_grpo_generates_and_is_exact():
    run = ScriptRun(str(SCRIPTS / "trl_grpo.py"))
    report, _ = predict_script(run)
    assert report.metadata.script["calls"]["generates"] >= 1
    assert any(e.phase is Phase.GENERATE for e in report.log.events)
    _exact(run)


def test_report_names_the_loop_the_versions_and_the_stand_ins(capsys):
    assert main(["run", PLAIN, "--steps", "1", "--", "--loop", "held"]) == 0
    out = capsys.readouterr().out
    assert "1 optimizer step of AdamW, 1 micro-batch (backward calls) each" in out
    assert "torch 2.13.0" in out and "transformers" in out
    assert "plain_loop.py:" in out and "stand-ins" in out  # `loss.item()` on a fake tensor


def test_json_and_check(capsys):
    assert main(["run", PLAIN, "--json", "--steps", "1", "--budget", "1MiB", "--check"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fit_check"]["fits"] is False
    assert out["script"]["calls"]["optimizer_steps"] == 1


def test_side_effects_stay_in_the_scratch_folder(tmp_path, monkeypatch, capsys):
    script = tmp_path / "writes.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters())\n"
                      "m(torch.ones(2, 4)).sum().backward(); opt.step()\n"
                      "torch.save(m.state_dict(), 'ckpt.pt')\nopen('log.txt', 'w').write('x')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(script), "--steps", "0", "--validate", "--tolerance", "0"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["writes.py"]
    out = capsys.readouterr().out
    assert "1 saves" in out


@pytest.mark.parametrize("body, message", [
    ("raise ValueError('bad data')\n", "bad.py failed (line 1): ValueError: bad data"),
    ("import sys\nsys.exit(3)\n", "bad.py exited with status 3"),
    ("from transformers import AutoConfig\nAutoConfig.from_pretrained('someone/some-model')\n",
     "asks the Hugging Face hub for"),
])
def test_a_failing_script_is_one_line_exit_2(tmp_path, capsys, body, message):
    script = tmp_path / "bad.py"
    script.write_text(body)
    assert main(["run", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("peakledger: error: script:")


@pytest.mark.parametrize("argv, message", [
    (["run", "missing.py"], "does not exist"),
    (["run", "README.md"], "is not a Python file"),
    (["run", PLAIN, "--steps", "-1"], "steps"),
    (["run", PLAIN, "--device", "TPU"], "allowed:"),
    (["run", PLAIN, "--check"], "--check needs a budget"),
])
def test_bad_input_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_clean_exit_ends_the_script(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text("import sys, torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.AdamW(m.parameters())\n"
                      "for _ in range(2):\n    m(torch.ones(3, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
                      "sys.exit(0)\n")
    report, _ = predict_script(ScriptRun(str(script), steps=None))
    assert report.metadata.script["calls"]["optimizer_steps"] == 2
    assert os.getcwd() != str(tmp_path)


def test_fsdp2_script_two_ranks_is_exact_rank_by_rank():
    """The peak exact on both ranks; every phase within the issue's 1%. The measured run's collectives return once
    gloo has released their tensors and its own copies (traces/harness.py `collectives_released`): without it, about
    one run in 40 under load had gloo's worker thread free its clone of the root's reduce-scatter input inside the
    next optimizer step (82,432 B more there, measured)."""
    run = ScriptRun(str(SCRIPTS / "fsdp2_loop.py"), world_size=2)
    report, _ = predict_script(run)
    validations = validate_script(run, report)
    assert len(validations) == 2
    for v in validations:
        assert v.overall.predicted == v.overall.measured
        off = [(v.name, p.label, p.measured, p.predicted) for p in v.phases if abs(p.error) > 0.01]
        assert off == [], off  # (the phases over 1% only, with their run)


def test_fsdp2_script_at_64_ranks_shards_the_state():
    small, _ = predict_script(ScriptRun(str(SCRIPTS / "fsdp2_loop.py"), world_size=2))
    large, _ = predict_script(ScriptRun(str(SCRIPTS / "fsdp2_loop.py"), world_size=64))
    assert large.log.metadata.rank_class_ranges == {"0": [[0, 63]]}
    state = lambda r: sum(b for c, b in r.peaks.overall.live_by_category.items()  # noqa: E731
                          if c.value in ("parameter", "optimizer_state"))
    assert state(large) < state(small)


@pytest.mark.parametrize("change, expected", [
    (["--micro-batch", "2"], ("--loop", "held", "--micro-batch", "2")),
    (["--loop", "dropped"], ("--loop", "dropped")),
    (["--loop=dropped"], ("--loop", "dropped")),
    (["--flag"], ("--loop", "held", "--flag")),
])
def test_a_tried_change_replaces_or_appends_the_scripts_own_flags(change, expected):
    from peakledger.script import with_args

    assert with_args(("--loop", "held"), change) == expected


def test_try_runs_each_change_and_ranks_by_the_budget(capsys):
    assert main(["run", PLAIN, "--json", "--steps", "1", "--budget", "7MiB", "--try", "--micro-batch 2",
                 "--try", "--loop dropped", "--", "--loop", "held"]) == 0
    out = json.loads(capsys.readouterr().out)
    tries = {t["args"]: t for t in out["tries"]}
    assert tries["--micro-batch 2"]["fits"] is True
    assert tries["--micro-batch 2"]["peak"] < tries["--loop dropped"]["peak"] < out["peak"]["bytes"]


def test_ddp_is_refused_with_the_reason(capsys):
    assert main(["run", str(SCRIPTS / "ddp_loop.py"), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "DistributedDataParallel, which does not run on fake tensors" in err and "FSDP2" in err


def test_local_weights_are_read_from_the_header_only(tmp_path):
    import torch
    from safetensors.torch import save_file
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from peakledger.models.script.weights import FakeSafeOpen

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7)}, str(path))
    with FakeTensorMode():
        f = FakeSafeOpen(str(path))
        a, b = f.get_tensor("a"), f.get_slice("b")[...]
    assert sorted(f.keys()) == ["a", "b"] and f.get_slice("a").get_shape() == [3, 5]
    assert isinstance(a, FakeTensor) and a.dtype == torch.bfloat16 and tuple(a.shape) == (3, 5)
    assert isinstance(b, FakeTensor) and tuple(b.shape) == (7,)


@pytest.mark.skipif(not _has("trl", "datasets"), reason="needs trl and datasets")
@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_trl_rl_from_a_model_folder_is_exact_but_its_load(tmp_path, trainer):
    # a Qwen2 policy by path (TRL builds the reference model from it), beta > 0: transformers' loader threads would
    # make the weights outside the fake mode (models/script/run.py SEQUENTIAL_LOAD); the load phase holds the
    # checkpoint's weights twice on the fake side (docs/rl.md)
    from peakledger.traces.reference.trl_run import make_model

    make_model(str(tmp_path / "model"))
    run = ScriptRun(str(SCRIPTS / "trl_rl.py"), ("--model", str(tmp_path / "model"), "--trainer", trainer))
    report, _ = predict_script(run)
    (v,) = validate_script(run, report)
    assert v.overall.predicted == v.overall.measured > 0
    for p in v.phases:
        if not p.label.startswith("load"):
            assert p.predicted == p.measured, p.label
