"""A deep HF model's recording derived from traces of 3 and 4 layers (models/traced/depth.py) equals the trace of the
whole model, item for item, on the programs the derivation serves (decoders of one repeated layer, CPU and CUDA
programs, mixed precision, checkpointing, LoRA, MoE; layers of two kinds that alternate, from 6 and 8 layers), and
is refused where layers differ."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from peakledger.models import traced as trace
from peakledger.models.config import TrainingSetup
from peakledger.models.traced import depth, from_hf_dict, recording

ROOT = Path(__file__).resolve().parents[1]
H100 = ((9, 0), "2.11")


@pytest.fixture(autouse=True)
def _in_this_process(monkeypatch):
    """Every trace in this process, where these tests count them (test_the_deeper_trace_runs_in_a_fork: beside it)."""
    monkeypatch.setenv("PEAKLEDGER_FORK", "0")


def _config(name: str, **extra) -> dict:
    return {**json.loads((ROOT / "examples" / name / "config.json").read_text()), **extra}


CASES = [
    ("hf-llama-tiny", {"num_hidden_layers": 6}, dict(precision="bf16-mixed"), H100),
    ("hf-llama-tiny", {"num_hidden_layers": 5, "attn_implementation": "sdpa"}, dict(precision="bf16"), H100),
    ("hf-llama-tiny", {"num_hidden_layers": 5}, dict(precision="fp32", checkpointing="full"), None),
    ("hf-llama-tiny", {"num_hidden_layers": 5, "attn_implementation": "sdpa"},
     dict(precision="bf16", lora_r=4, lora_alpha=8, lora_targets=("q_proj", "v_proj")), H100),
    ("hf-gpt2-tiny", {"n_layer": 6}, dict(precision="bf16-autocast"), H100),
    ("hf-mixtral-tiny", {"num_hidden_layers": 5}, dict(precision="bf16-autocast"), H100),
]


@pytest.mark.parametrize("name, extra, training, target", CASES)
def test_derived_recording_equals_the_whole_trace(name, extra, training, target, monkeypatch):
    model = from_hf_dict(_config(name, **extra), f"{name}-deep")
    n = next(v for k, v in extra.items() if k in depth.LAYER_KEYS)
    setup = TrainingSetup(micro_batch=2, seq_len=16, **training)
    traced = []
    whole_trace = trace._trace

    def counted(m, s, t):
        traced.append(json.loads(m.source).get(depth.layer_key(json.loads(m.source))))
        return whole_trace(m, s, t)

    monkeypatch.setattr(trace, "_trace", counted)
    enabled = gc.isenabled()
    gc.disable()  # as describe() records (simulator/gcpause.py): deaths by reference counts only
    try:
        assert depth.uniform(model, setup)
        derived = recording(model, setup, target)
        assert n not in traced and set(traced) <= {3, 4}  # derived from 3 and 4 layers, not traced whole
        whole = recording(model, setup, target, by_depth=False)
    finally:
        if enabled:
            gc.enable()
    assert len(derived.layers) == len(whole.layers) == n
    assert depth.same(derived, whole)


def test_layers_that_differ_are_not_derived():
    # Gemma2 alternates sliding-window and global attention: its layers are not alike module for module
    model = from_hf_dict(_config("hf-gemma2-tiny", num_hidden_layers=6), "gemma2-deep")
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16")
    assert not depth.uniform(model, setup)
    # and a 3-layer recording does not stand for a model whose layers alternate (derivation refused or unequal)
    three = recording(from_hf_dict(_config("hf-gemma2-tiny", num_hidden_layers=3), "g3"), setup, H100)
    four = recording(from_hf_dict(_config("hf-gemma2-tiny", num_hidden_layers=4), "g4"), setup, H100)
    try:
        assert not depth.same(depth.derive(three, 4), four)
    except depth.NotPeriodic:
        pass


def test_alternating_layers_are_derived_by_period():
    # Gemma2 alternates sliding-window and full-attention layers (its config's layer_types): every 2 layers repeat,
    # so 10 layers are derived from traces of 6 and 8 (3 and 4 periods) and equal the whole trace item for item
    # (checkpointed, as the README's Gemma-2 example: the model then runs without its KV cache, whose sliding-window
    # layers each make a scalar at the model's level, outside any layer, which no derivation places)
    model = from_hf_dict(_config("hf-gemma2-tiny", num_hidden_layers=10), "gemma2-10")
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16", checkpointing="full")
    assert depth.period(model, setup) == 2
    traced = []
    whole_trace = trace._trace

    def counted(m, s, t):
        traced.append(json.loads(m.source)["num_hidden_layers"])
        return whole_trace(m, s, t)

    enabled = gc.isenabled()
    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trace, "_trace", counted)
            derived = recording(model, setup, H100)
        assert traced == [6, 8]
        whole = recording(model, setup, H100, by_depth=False)
    finally:
        if enabled:
            gc.enable()
    assert derived.layers == whole.layers == tuple(f"model.layers.{i}" for i in range(10))
    assert depth.same(derived, whole)
    # an explicit layer_types list of the deep model is cut to the shallow ones' depth
    kinds = ["sliding_attention", "full_attention"] * 5
    explicit = from_hf_dict(_config("hf-gemma2-tiny", num_hidden_layers=10, layer_types=kinds), "gemma2-10-explicit")
    assert depth.same(recording(explicit, setup, H100), whole)
    # with the KV cache (not checkpointed) 8 layers derived from 6 differ from their trace: the model is traced whole
    traced.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace, "_trace", counted)
        recording(model, TrainingSetup(micro_batch=2, seq_len=16, precision="bf16"), H100)
    assert traced == [6, 8, 10]


def test_layers_without_a_period_are_traced_whole(monkeypatch):
    # two sliding-window layers then eight full-attention ones: no period repeats three times
    kinds = ["sliding_attention"] * 2 + ["full_attention"] * 8
    model = from_hf_dict(_config("hf-gemma2-tiny", num_hidden_layers=10, layer_types=kinds), "gemma2-irregular")
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16")
    assert depth.period(model, setup) is None
    traced = []
    whole_trace = trace._trace
    monkeypatch.setattr(trace, "_trace", lambda m, s, t: traced.append(json.loads(m.source)["num_hidden_layers"])
                        or whole_trace(m, s, t))
    assert len(recording(model, setup, H100).layers) == 10
    assert traced == [10]
    # a period that does not repeat in whole periods is none either
    assert depth.period_of([("a",), ("b",), ("a",), ("b",), ("a",)]) is None
    assert depth.period_of([("a",), ("b",)] * 3) == 2
    assert depth.period_of([("a",)] * 3) == 1


def test_layer_key_names_one_stack():
    assert depth.layer_key({"num_hidden_layers": 32}) == "num_hidden_layers"
    assert depth.layer_key({"n_layer": 12}) == "n_layer"
    assert depth.layer_key({"num_layers": 6, "num_decoder_layers": 6}) is None  # an encoder-decoder: two stacks


def test_the_deeper_trace_runs_in_a_fork_beside_this_one(monkeypatch, tmp_path):
    # models/forked.py: the 8-layer trace in a forked child while this process traces 6 layers; the same recording
    monkeypatch.setenv("PEAKLEDGER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("peakledger.models.forked.worth_forking", lambda: True)
    trace.forget()  # (another test of this process may have traced the same shallow models)
    model = from_hf_dict(_config("hf-gemma2-tiny", num_hidden_layers=10), "gemma2-10-forked")
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16", checkpointing="full")
    traced = []
    whole_trace = trace._trace

    def counted(m, s, t):
        traced.append(json.loads(m.source)["num_hidden_layers"])
        return whole_trace(m, s, t)

    monkeypatch.setattr(trace, "_trace", counted)
    forked = recording(model, setup, H100)
    assert traced == [6]  # (the child's count is its own)
    assert len(list(tmp_path.glob("rec-*"))) == 3  # 6, 8 and 10 layers on disk, the child's entry included
    trace.forget()
    monkeypatch.setattr("peakledger.models.forked.worth_forking", lambda: False)
    monkeypatch.setenv("PEAKLEDGER_CACHE_DIR", str(tmp_path / "here"))
    here = recording(model, setup, H100)
    assert traced == [6, 6, 8] and depth.same(forked, here)
