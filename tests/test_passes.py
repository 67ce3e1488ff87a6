"""passes "forward" (models/config.py PASSES): `out = model(batch)` with autograd on and nothing after it, against
a real CPU forward under the project's allocation tracker (traces/tracker/), for a traced module and for the
hand-written describers' tape without its loss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from peakledger import api
from peakledger.cli import main
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Phase
from peakledger.traces.tracker import AllocationTracker, peak

CS336 = Path(__file__).resolve().parent.parent / "examples" / "modules" / "cs336_lm.py"


def real_forward_peak(micro_batch: int, seq_len: int) -> int:
    spec = importlib.util.spec_from_file_location("cs336_lm_test", CS336)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, batch, _ = module.tiny_factory(micro_batch, seq_len)
    tracker = AllocationTracker(model, None, known=(batch,))
    with tracker:
        with tracker.phase(Phase.FORWARD, 1, 0):
            x = batch.clone()
            tracker.mark_input(x)
            out = model(x)
            del out, x
            tracker.scan()
    return peak(tracker.log())[0]


@pytest.mark.parametrize("seq_len", [16, 48])
def test_a_traced_forward_pass_equals_a_real_one(seq_len):
    sc = build_scenario({"module": f"{CS336}:tiny_factory"},
                        {"micro_batch": 2, "seq_len": seq_len, "precision": "fp32", "passes": "forward", "steps": 1},
                        {"device": "cpu"})
    report = api.run(sc)
    assert report.peaks.overall.bytes == real_forward_peak(2, seq_len)
    assert report.peaks.overall.event.op.startswith("lm_head")  # the output is the last thing made and kept
    phases = {e.phase for e in report.log.events}
    assert phases == {Phase.LOAD, Phase.FORWARD}  # no loss, backward, optimizer step or zero_grad
    assert all(e.block.category.value not in ("gradient", "optimizer_state") for e in report.log.events)


def test_hand_written_forward_drops_the_loss_and_frees_everything_at_the_end():
    train = api.run(build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, "steps": 1},
                                   {"device": "cpu"}))
    fwd = api.run(build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, "steps": 1, "passes": "forward"},
                                 {"device": "cpu"}))
    assert not any(e.op.startswith("loss.") for e in fwd.log.events)
    assert fwd.peaks.overall.bytes < train.peaks.overall.bytes
    live = 0
    for e in fwd.log.events:
        if e.phase is not Phase.LOAD:
            live += e.delta
    assert live == 0  # every forward allocation is freed when the caller drops the output


@pytest.mark.parametrize("changes,field", [({"world_size": 2}, "world_size"), ({"grad_accum": 2}, "grad_accum"),
                                           ({"checkpoint_every": 1}, "checkpoint_every"),
                                           ({"passes": "backward"}, "passes")])
def test_forward_passes_refuse_what_they_never_run(changes, field):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**{"passes": "forward", **changes})
    assert e.value.field == field


def test_validate_refuses_forward_passes(capsys):
    assert main(["validate", "--preset", "tiny", "--passes", "forward"]) == 2
    assert "passes" in capsys.readouterr().err
