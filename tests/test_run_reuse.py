"""What one process reuses between the runs of explain's fixes, a GPU-count search or max-batch (issue 39), each
checked against the work it spares: a recording's tape (models/traced `_TAPES`) against convert.py's, a HF model's
layer fingerprints (`_PRINTS`) against depth.py's, `tensors_in` against torch's `tree_flatten` (and no reference
cycle left behind), the collector's pause (simulator/gcpause.py) against its own rule, and a report's ledger made
when read against the one `ledger_at` gives."""

from __future__ import annotations

import collections
import gc
import json
import random
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten

import peakledger.models.traced as trace
import peakledger.simulator.gcpause as gcpause
from peakledger import api
from peakledger.analysis.ledger import ledger_at
from peakledger.diagnosis import explain
from peakledger.models.config import TrainingSetup
from peakledger.models.traced import depth, from_hf_dict, traced_tape
from peakledger.models.traced.convert import to_tape
from peakledger.models.traced.shadows import tensors_in
from peakledger.scenario import build_scenario

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "examples" / "hf-llama-tiny" / "config.json").read_text())
BASE = TrainingSetup(micro_batch=1, seq_len=16, precision="bf16-mixed", checkpointing="full")


def test_a_tape_is_made_once_per_recording_and_setup_and_each_caller_gets_its_own_lists(trace_disk):
    model = from_hf_dict(TINY, "tiny")
    first = traced_tape(model, BASE, cpu=True)
    first.ops.append(first.ops[0])  # (a caller that changes the tape it was given)
    first.params.clear()
    again = traced_tape(model, BASE, cpu=True)
    rec = trace.recording(model, BASE)
    made = to_tape(rec, BASE, rec.layers, describer=again.describer)
    assert again == made
    # another optimizer or world size: the same tape; another checkpointing: its own
    assert traced_tape(model, BASE.replace(optimizer="sgd"), cpu=True) == made
    every = BASE.replace(checkpointing="every-k", checkpoint_every_k=2)  # (the same recording: layers checkpointed)
    assert trace.recording(model, every) is rec
    other = traced_tape(model, every, cpu=True)
    assert other == to_tape(rec, every, rec.layers, describer=again.describer) and other != made
    assert traced_tape(model, BASE) != made  # the CUDA program's tape (gpu_paths.py) is not the CPU one


def test_fingerprints_are_kept_by_what_the_build_reads(trace_disk):
    model = from_hf_dict({**TINY, "num_hidden_layers": 6}, "six")
    for setup in (BASE, BASE.replace(micro_batch=3, seq_len=8), BASE.replace(checkpointing="none"),
                  BASE.replace(lora_r=4)):
        assert trace._fingerprints(model, setup) == depth.fingerprints(model, setup)
    assert trace._fingerprints(model, BASE.replace(lora_r=4)) != trace._fingerprints(model, BASE)
    trace.forget()
    assert not trace._PRINTS and not trace._TAPES


def _tree(rng: random.Random, tensors: list, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 4)
    if kind in (0, 3):
        return rng.choice(tensors)
    if kind == 1:
        return rng.choice([1, 2.0, None, "x", True, torch.float32, torch.device("cpu"), torch.Size([2, 3])])
    if kind == 2:
        return torch.Size([rng.randrange(4)])
    items = [_tree(rng, tensors, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 4:
        return tuple(items)
    if kind == 5:
        return items
    if kind == 6:
        return {f"k{i}": v for i, v in enumerate(items)}
    if kind == 7:
        return collections.namedtuple("Pair", "a b")(_tree(rng, tensors, depth + 1), _tree(rng, tensors, depth + 1))
    return collections.OrderedDict((f"k{i}", v) for i, v in enumerate(items))


def test_tensors_in_is_tree_flattens_tensors_and_leaves_no_cycle():
    rng = random.Random(0)
    tensors = [torch.zeros(k + 1) for k in range(4)] + [torch.nn.Parameter(torch.ones(2))]
    for _ in range(3000):
        tree = _tree(rng, tensors)
        want = [a for a in tree_flatten(tree)[0] if isinstance(a, torch.Tensor)]
        got = tensors_in(tree)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), tree
    args = ((tensors[0], [tensors[1], 2], None), {"dim": 1, "out": tensors[2]})
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(100):
            tensors_in(args)
        assert gc.collect() == 0  # (torch 2.13's tree_flatten leaves its recursive helper in a cycle, per call)
    finally:
        if was:
            gc.enable()


def test_the_first_paused_block_takes_what_the_process_holds_as_its_base(monkeypatch):
    monkeypatch.setattr(gcpause, "_COUNTS", {"long_lived": 0, "bound": 0})
    collected = []
    real = gcpause.gc.collect
    monkeypatch.setattr(gcpause.gc, "collect", lambda *a: collected.append(1) or real(*a))
    held = [[k] for k in range(gcpause.FLOOR + 100_000)]  # live objects past FLOOR before the first block
    with gcpause.paused_gc():
        pass
    base = gcpause._COUNTS["long_lived"]
    assert base >= len(held) and not collected  # (counted, not collected: none of it is garbage)
    with gcpause.paused_gc():
        more = [[k] for k in range(int(base * (gcpause.GROWTH - 1)) + 100_000)]  # past GROWTH x the base
    with gcpause.paused_gc():
        pass
    assert collected == [1] and gcpause._COUNTS["long_lived"] >= len(held) + len(more)


@pytest.mark.parametrize("device", ["cpu", "H100-80GB"])
def test_a_reports_ledger_is_made_when_read_and_is_ledger_at_its_peak(device):
    report = api.run(build_scenario({"preset": "tiny"}, {"micro_batch": 2}, {"device": device}))
    assert "ledger" not in vars(report)  # (not made by summarize)
    rows = report.ledger
    assert rows and rows == ledger_at(report.timeline, report.peaks.overall.index)
    assert sum(r.bytes for r in rows) == report.peaks.overall.bytes


def test_max_batch_and_explain_take_the_callers_last_report_of_their_scenario(monkeypatch):
    scenario = build_scenario({"preset": "tiny"}, {"micro_batch": 2}, {"device": "cpu"})
    ran = []
    real = api._run
    monkeypatch.setattr(api, "_run", lambda sc, *a: ran.append(sc.setup.batch.micro_batch) or real(sc, *a))
    report = api.run(scenario)
    assert api.run(scenario) is not report and ran == [2, 2]  # (outside them, every call runs)
    budget = report.capacity_needed * 3
    api._LAST.clear()  # (max-batch as it was: every probe run)
    del ran[:]
    anew = api.max_micro_batch(scenario, budget)
    assert 2 in ran
    report = api.run(scenario)
    del ran[:]
    assert api.max_micro_batch(scenario, budget) == anew and 2 not in ran  # (its own size: the caller's report)
    x = explain(scenario, report.capacity_needed // 2)
    assert x.report is report
    other = api.run(scenario.with_changes(micro_batch=3))
    assert api._LAST == [(scenario.with_changes(micro_batch=3), other)]  # (only the last kept)
