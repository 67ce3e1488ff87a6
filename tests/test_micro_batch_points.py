"""A first trace of a deep model under `micro_batch_points` (what `peakledger simulate` runs) records micro-batch
sizes 2, 3 and 4 beside its own (models/traced `_other_sizes`), so that a second call at any other micro-batch derives
its recording (scale.py) and traces nothing: checked against the trace of every layer at that size, and in a new
process that imports neither torch nor transformers. Off by default (explain's candidates, `where`'s cards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import peakledger.models.traced as trace
from peakledger.models.config import TrainingSetup
from peakledger.models.traced import depth, from_hf_dict, micro_batch_points, recording, scale, store

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "examples" / "hf-llama-tiny" / "config.json").read_text())
DEEP = {**TINY, "num_hidden_layers": 8}
BASE = TrainingSetup(micro_batch=1, seq_len=16, precision="bf16-mixed")


def _sizes(folder: Path, model, setup, target=None) -> list[int]:
    return store.entry(model, trace._key(model, setup, target), 0, "none").sizes() if folder.exists() else []


@pytest.mark.parametrize("target", [None, ((9, 0), "2.13")])
def test_a_first_trace_records_sizes_2_to_4_and_every_other_size_is_derived_exactly(trace_disk, traces_run, target):
    model = from_hf_dict(DEEP, "deep")
    with micro_batch_points(True):
        recording(model, BASE, target)
    # 3 and 4 layers at its own size (the depth derivation checked), 3 layers at 2, 3 and 4
    assert traces_run == [(3, 1), (4, 1), (3, 2), (3, 3), (3, 4)]
    assert _sizes(trace_disk, model, BASE, target) == [1, 2, 3, 4]
    trace.forget()  # a new process: what is on disk only
    for b in (3, 5):  # (3: recorded beside the first, from 3 layers; 5: derived from 2, 3 and 4)
        setup = BASE.replace(micro_batch=b)
        got = recording(model, setup, target)
        assert depth.same(got, trace._trace(model, setup, target)), b  # the trace of all 8 layers at that size
    assert traces_run[5:] == [(8, 3), (8, 5)]  # (only the checks traced)


def test_off_by_default_and_not_again_once_three_sizes_are_had(trace_disk, traces_run):
    model = from_hf_dict(DEEP, "deep")
    recording(model, BASE)
    assert traces_run == [(3, 1), (4, 1)] and _sizes(trace_disk, model, BASE) == [1]
    with micro_batch_points(True):
        for b in (2, 3, 4):
            recording(model, BASE.replace(micro_batch=b))
    assert traces_run[2:] == [(3, 2), (4, 2), (3, 3), (3, 4)]  # 2 records 3 and 4 beside it; then three are had
    with micro_batch_points(True):
        eight = recording(model, BASE.replace(seq_len=8))  # another recording: its own sizes
    # (no 4-layer check: the program of micro-batch 1 at sequence 16, whose derivation was shown, only smaller)
    assert traces_run[6:] == [(3, 1), (3, 2), (3, 3), (3, 4)]
    assert depth.same(eight, trace._trace(model, BASE.replace(seq_len=8), None))


WARM = """
import json, sys
from peakledger.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}),
      file=sys.stderr)
"""


def test_simulate_then_another_micro_batch_imports_neither_torch_nor_transformers(tmp_path):
    config = tmp_path / "deep.json"
    config.write_text(json.dumps(DEEP))
    env = {**os.environ, store.DIR_ENV: str(tmp_path / "traces_run"), "PYTHONWARNINGS": "ignore"}

    def run(b: int, *extra: str):
        argv = ["simulate", "--hf-config", str(config), "--micro-batch", str(b), "--seq-len", "16", "--json", *extra]
        p = subprocess.run([sys.executable, "-c", WARM, *argv], env=env, capture_output=True, text=True, cwd=tmp_path)
        return json.loads(p.stdout), json.loads(p.stderr.strip().splitlines()[-1])

    _, cold = run(1)
    assert cold == {"rc": 0, "torch": True, "transformers": True}
    second, warm = run(6)
    assert warm == {"rc": 0, "torch": False, "transformers": False}
    traced, _ = run(6, "--no-cache")  # traced from scratch, nothing read
    assert second == traced


def test_the_depth_check_is_traced_once_per_program(trace_disk, traces_run):
    """The trace of 4p layers that shows a depth derivation exact is made once per program: another micro-batch of
    the same program (the same ops, storages and nodes: scale.py `signature`) is derived from its 3p layers alone, and
    equals the trace of all its layers; a size of another program (1, where a size-1 dimension spares a copy) is
    checked again."""
    model = from_hf_dict(DEEP, "deep")
    recording(model, BASE.replace(micro_batch=2))
    assert traces_run == [(3, 2), (4, 2)]
    five = recording(model, BASE.replace(micro_batch=5))
    assert traces_run[2:] == [(3, 5)]  # (no fourth layer: the program shown at 2)
    assert depth.same(five, trace._trace(model, BASE.replace(micro_batch=5), None))
    del traces_run[3:]
    recording(model, BASE)  # micro-batch 1
    one = trace._trace(model, BASE, None)
    assert scale.signature(one) != scale.signature(trace._trace(model, BASE.replace(micro_batch=2), None))
    assert traces_run[3:5] == [(3, 1), (4, 1)]  # another program: its own check
    trace.forget()  # a new process knows of no check (the 4p trace is made again)
    recording(model, BASE.replace(micro_batch=6))
    assert traces_run[-2:] == [(3, 6), (4, 6)]


def test_another_sequence_length_of_the_same_program_is_not_checked_again(trace_disk, traces_run):
    model = from_hf_dict(DEEP, "deep")
    recording(model, BASE.replace(micro_batch=2))
    eight = recording(model, BASE.replace(micro_batch=2, seq_len=8))
    assert traces_run == [(3, 2), (4, 2), (3, 2)]  # (the second: 3 layers at sequence 8 only)
    assert depth.same(eight, trace._trace(model, BASE.replace(micro_batch=2, seq_len=8), None))
