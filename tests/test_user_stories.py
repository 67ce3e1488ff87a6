"""The questions users bring (issue 25), replayed end to end: an OOM at the first checkpoint save, an OOM at the
first optimizer step told phase by phase, and a run that fits with its margins and first-step risks. Expected
figures are computed from the model's sizes or from separate simulations of the fixed scenario, never copied."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from peakledger import api, diagnosis
from peakledger.cli import main
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Phase

GiB = 1 << 30
SAVE_STORY = ["explain", "--preset", "llama-3-8b", "--dp-engine", "fsdp2", "--world-size", "8", "--precision",
              "bf16-mixed", "--checkpoint-every", "1", "--save-mode", "full-rank0", "--device", "H100-80GB",
              "--budget", "80GiB"]
# a 1.5B Llama-shaped model, full fp32 AdamW fine-tune at micro-batch 1 x 1024 on a 24 GiB card
FIRST_STEP = {"preset": "tiny-llama", "n_layer": 16, "d_model": 2048, "n_head": 32, "n_kv_head": 8, "d_ff": 8192,
              "vocab_size": 128256, "max_seq_len": 4096}
FIRST_STEP_TRAINING = {"precision": "fp32", "seq_len": 1024, "micro_batch": 1}


@pytest.fixture(scope="module")
def save_story():
    """`explain` of an FSDP2 Llama-3-8B run whose rank 0 gathers the full state dict on its GPU at the first save."""
    return json.loads(_cli(*SAVE_STORY, "--json")[1])


def _cli(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_save_oom_is_placed_at_the_first_save_with_its_gathered_copies(save_story):
    x = save_story
    assert not x["fits"] and x["where"].startswith("step 1's checkpoint save (save_mode full-rank0") \
        and x["where"].endswith("rank 0")
    assert x["moment"]["phase"] == "checkpoint" and x["moment"]["step"] == 1
    assert any(line.startswith("the save's gathered copies") for line in x["first_step"])
    phases = {(p["step"], p["phase"]): p for p in x["phases"]}
    assert phases[(1, "checkpoint")]["device_total"] > 80 * GiB > phases[(1, "backward")]["device_total"]


def test_save_oom_fixes_rank_the_save_modes_first_and_list_only_what_helps(save_story):
    fixes = save_story["fixes"]
    first = [f for f in fixes if f["fits"] and not f["changes_training"]]
    assert first and all(f["name"].startswith("save_mode full-rank0 -> ") for f in first)
    assert fixes[:len(first)] == first  # ranked before the fixes that change the training (8-bit Adam, freezing)
    assert {f["changes"]["save_mode"] for f in first} >= {"full-rank0-offload", "sharded"}
    # a save that gathers nothing on the device peaks where the run without any save does
    no_save = api.run(build_scenario({"preset": "llama-3-8b"}, {"dp_engine": "fsdp2", "world_size": 8,
                                                                "precision": "bf16-mixed"}, {"device": "H100-80GB"}))
    assert {f["peak"] for f in first} == {no_save.peaks.overall.bytes}
    base_peak = save_story["peak"]
    assert all(f["fits"] or f["peak"] < base_peak or set(f["changes"]) <= {"alloc_conf", "empty_cache_before_save"}
               for f in fixes)
    assert not any(f["name"].startswith("checkpointing=") for f in fixes)  # activations are not the problem
    assert save_story["fixes_tried"] > len(fixes)


def test_save_oom_check_exits_1_and_its_fix_exits_0():
    code, out = _cli(*SAVE_STORY, "--check")
    assert code == 1 and out.rstrip().splitlines()[-1].startswith("fit check: DOES NOT FIT")
    code, out = _cli(*[a if a != "full-rank0" else "sharded" for a in SAVE_STORY], "--check")
    assert code == 0 and out.rstrip().splitlines()[-1].startswith("fit check: FITS")


def test_first_step_oom_told_phase_by_phase():
    scenario = build_scenario(FIRST_STEP, FIRST_STEP_TRAINING, {"device": "H100-80GB"})
    budget = 24 * GiB
    x = diagnosis.explain(scenario, budget)
    n = api.run(scenario).metadata.n_params
    assert not x.fits and x.where == "step 1's optimizer step (adamw, foreach), rank 0"
    lazy = next(line for line in x.first_step if line.startswith("lazy optimizer states"))
    assert "recurs" in lazy
    # AdamW keeps exp_avg and exp_avg_sq in fp32: 8 bytes a parameter, created inside the first step()
    states = sum(b for c, b in x.moment.by_category.items() if c.value == "optimizer_state")
    assert states + (x.moment.event.block.nbytes if x.moment.event.block.category.value == "optimizer_state"
                     else 0) <= 8 * n
    phases = {(p.step, p.phase): p for p in x.phases}
    assert phases[(0, Phase.LOAD)].allocated >= 4 * n  # the fp32 parameters
    assert phases[(1, Phase.FORWARD)].device_total < budget < phases[(1, Phase.OPTIMIZER)].device_total
    assert phases[(1, Phase.BACKWARD)].device_total < budget
    assert x.fixes and x.fixes[0].fits and not x.fixes[0].more_gpus


def test_a_run_that_fits_says_its_margins_and_first_step_risks():
    code, out = _cli("explain", "--preset", "tiny", "--device", "H100-80GB", "--budget", "24GiB", "--check")
    assert code == 0
    assert "fits a budget of 24 GiB" in out and "peak by phase" in out
    assert "what commonly makes a real first step worse" in out and "no checkpoint save is simulated" in out
    assert out.rstrip().splitlines()[-1].startswith("fit check: FITS")
