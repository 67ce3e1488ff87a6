"""Checkpoint save and load (models/checkpoint_io/): the spikes each mode predicts, computed here from the
model's parameter shapes; the save as the run's peak; default runs unchanged; field errors; and real CPU
saves and loads under the exact allocation tracker against the simulation (bench/validate_checkpoint_io.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from peakledger.analysis.report import summarize
from peakledger.analysis.report_text import render_text
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.models.transformer import transformer_params
from peakledger.scenario import build_scenario
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Category, Phase, Pool
from peakledger.simulator.timeline import timeline

BENCH = Path(__file__).resolve().parents[1] / "bench"
_spec = importlib.util.spec_from_file_location("validate_checkpoint_io", BENCH / "validate_checkpoint_io.py")
vc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("validate_checkpoint_io", vc)  # dataclasses look their module up while the file runs
_spec.loader.exec_module(vc)

CFG = preset("tiny")  # gpt2 family: tied embeddings; fp32 AdamW by default
SMALL = dict(micro_batch=1, seq_len=8, steps=2)
ADAM_TENSORS = 3  # a parameter, exp_avg, exp_avg_sq: all fp32 and of the parameter's shape


def run(device="H100-80GB", cfg=CFG, ranks=None, **setup):
    graph = describe(cfg, TrainingSetup(**{**SMALL, **setup}), device, ranks=ranks)
    return graph, simulate(graph)


def spike(log, phase=Phase.CHECKPOINT, step=1, pool=Pool.DEVICE, rank=0) -> int:
    return vc.phase_spike(log, phase, step, pool, rank)


def param_numels(cfg=CFG) -> list[int]:
    return [math.prod(p.shape) for p in transformer_params(cfg)]


def tied_numel(cfg=CFG) -> int:
    """The tied output embedding, a state-dict key of its own (`lm_head.weight`)."""
    return cfg.vocab_size * cfg.d_model if cfg.tied else 0


# -- what each mode allocates --------------------------------------------------------------------------

def test_full_rank0_without_offload_is_the_runs_peak_and_the_report_names_the_checkpoint():
    graph, log = run(dp_engine="fsdp2", world_size=2, checkpoint_every=1, save_mode="full-rank0")
    _, plain = run(dp_engine="fsdp2", world_size=2)
    report = summarize(log)
    peak = report.peaks.overall
    assert report.peaks.rank == 0 and peak.event.phase is Phase.CHECKPOINT
    assert peak.live_by_category[Category.CHECKPOINT_STAGING] > 0
    assert peak.bytes > summarize(plain).peaks.overall.bytes
    assert "(checkpoint, step" in render_text(report)
    # rank 0 keeps every gathered tensor: 2 x ceil(dim0 / 2) rows of each parameter and its two Adam states,
    # and the tied embedding's second key once more
    shapes = [p.shape for p in transformer_params(CFG)]
    gathered = sum(2 * math.ceil(s[0] / 2) * math.prod(s[1:]) * 4 for s in shapes)
    wte = 2 * math.ceil(CFG.vocab_size / 2) * CFG.d_model * 4
    assert spike(log, rank=0) == ADAM_TENSORS * gathered + wte
    # the other rank drops each one at once: the largest gathered tensor
    largest = max(2 * math.ceil(s[0] / 2) * math.prod(s[1:]) * 4 for s in shapes)
    assert spike(log, rank=1) == largest
    assert graph.metadata.rank_classes == {"0": [0], "1": [1]}


def test_offloaded_full_state_lands_on_rank0s_host_and_spares_its_device():
    _, log = run(dp_engine="fsdp2", world_size=2, checkpoint_every=1, save_mode="full-rank0-offload")
    full = sum(param_numels()) * 4 * ADAM_TENSORS + tied_numel() * 4
    assert spike(log, pool=Pool.HOST) == full
    assert summarize(log).peaks.overall.event.phase is not Phase.CHECKPOINT
    host = summarize(log, pool=Pool.HOST)
    assert host.peaks.overall.event.phase is Phase.CHECKPOINT and host.peaks.rank == 0


def test_torch_save_stages_one_host_copy_at_a_time():
    _, log = run(checkpoint_every=1, save_mode="torch-save")
    assert spike(log, pool=Pool.HOST) == max(param_numels()) * 4
    assert spike(log, pool=Pool.DEVICE) == 0
    _, cpu = run("cpu", checkpoint_every=1, save_mode="torch-save")
    assert spike(cpu) == 0  # storage.cpu() of a CPU storage is the storage


def test_sharded_save_keeps_every_staged_copy_until_the_file_is_written():
    _, log = run(checkpoint_every=1, save_mode="sharded")
    assert spike(log, pool=Pool.HOST) == (sum(param_numels()) * ADAM_TENSORS + tied_numel()) * 4
    tl = timeline(log, 0, Pool.HOST)
    assert tl.live_at(len(tl.events) - 1).get(Category.CHECKPOINT_STAGING, 0) == 0


def test_async_staging_buffer_is_allocated_once_and_reused():
    _, log = run(checkpoint_every=1, save_mode="async")
    steps = len(param_numels())  # Adam's step: one 4-byte host tensor per parameter, staged too
    placeholder = 4  # one fp32 element while each copy is made
    state = sum(param_numels()) * ADAM_TENSORS * 4 + steps * 4
    assert spike(log, pool=Pool.HOST, step=1) == state + placeholder
    assert spike(log, pool=Pool.HOST, step=2) == placeholder
    staged = timeline(log, 0, Pool.HOST)
    assert staged.live_at(len(staged.events) - 1)[Category.CHECKPOINT_STAGING] == state


def test_loads_by_mode_and_no_state_creation_in_the_first_step():
    params = sum(param_numels()) * 4
    states = 2 * params
    steps = len(param_numels()) * 4
    # through the device: one host buffer at a time, while Adam's host `step` tensors (4 B, one per
    # parameter, read in parameter order before its exp_avg) stay on the host as they are read
    one_at_a_time = max(n * 4 + 4 * (k + 1) for k, n in enumerate(param_numels()))
    for mode, host, device_extra in [("full-then-device", params + states + steps, states),
                                     ("map-to-device", one_at_a_time, params + states),
                                     ("meta-assign", one_at_a_time, states)]:
        _, log = run(load_mode=mode)
        assert spike(log, Phase.LOAD, 0, Pool.HOST) == host, mode
        device = timeline(log)
        before_load = device.peak(lambda e: e.phase is Phase.LOAD and e.op == "load.parameters").bytes
        assert device.peak(lambda e: e.phase is Phase.LOAD).bytes - before_load == device_extra, mode
        assert not any(e.op == "optimizer.init_state" for e in log.events), mode
        _, fresh = run()
        assert timeline(log).peak(lambda e: e.step == 2).bytes == timeline(fresh).peak(lambda e: e.step == 2).bytes


def test_per_rank_saves_split_rank_classes_only_when_saving():
    graph, log = run(dp_engine="ddp", world_size=3, checkpoint_every=1, save_mode="torch-save")
    assert graph.metadata.rank_classes == {"0": [0], "1": [1, 2]}
    assert spike(log, pool=Pool.HOST, rank=0) > 0 and spike(log, pool=Pool.HOST, rank=1) == 0
    quiet, _ = run(dp_engine="ddp", world_size=3, save_mode="torch-save")
    assert quiet.metadata.rank_classes == {"0": [0, 1, 2]}


# -- defaults and errors -------------------------------------------------------------------------------

def _events(log):
    return [(e.seq, e.time, e.action, e.block, e.phase, e.step, e.op) for e in log.events]


@pytest.mark.parametrize("setup", [dict(), dict(dp_engine="fsdp2", world_size=2), dict(zero_stage=3, world_size=2)])
def test_default_runs_are_byte_identical(setup):
    graph, log = run(**setup)
    for mode in ("async", "full-rank0", "sharded"):
        other_graph, other = run(**setup, save_mode=mode)  # a save mode without checkpoint_every saves nothing
        assert _events(other) == _events(log)
        assert other_graph.metadata.rank_classes == graph.metadata.rank_classes
    assert not any(e.phase is Phase.CHECKPOINT or e.block.category is Category.CHECKPOINT_STAGING
                   for e in log.events)


@pytest.mark.parametrize("field, value", [("save_mode", "pickle"), ("load_mode", "lazy"), ("checkpoint_every", -1),
                                          ("checkpoint_every", True), ("checkpoint_every", 1.5)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**{field: value})
    assert e.value.field == field
    with pytest.raises(ConfigError) as e:
        build_scenario({"preset": "tiny"}, {field: value})
    assert e.value.field == field


def test_unknown_mode_lists_the_allowed_ones_and_zero_redundancy_full_is_refused():
    with pytest.raises(ConfigError, match="torch-save.*full-rank0.*sharded.*async"):
        TrainingSetup(save_mode="pickle")
    with pytest.raises(ConfigError, match="full-then-device.*meta-assign") as e:
        TrainingSetup(load_mode="lazy")
    with pytest.raises(ConfigError) as e:
        TrainingSetup(dp_engine="zero-redundancy-optimizer", world_size=2, save_mode="full-rank0")
    assert e.value.field == "save_mode"


# -- real CPU runs against the model ("cpu" profile) ---------------------------------------------------

TINY = vc.CONFIGS[0]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("mode", ["torch-save", "async", "sharded"])
def test_cpu_saves_match_the_model_to_the_byte(mode):
    r = vc.save_case(TINY, mode)
    for s in r["steps"]:
        assert s["measured"] == s["predicted"], (mode, s)
    assert abs(r["overall"].error) <= 0.01
    if mode == "async":  # the CPU does stage: a full copy at the first save, none at the second
        assert r["steps"][0]["measured"] > 1000 * r["steps"][1]["measured"] > 0


@pytest.mark.parametrize("mode", ["full-then-device", "meta-assign"])
def test_cpu_loads_match_the_model_to_the_byte(mode):
    r = vc.load_case(TINY, mode)
    assert r["load_peak"].measured == r["load_peak"].predicted
    assert abs(r["overall"].error) <= 0.01


def test_dcp_writer_keeps_every_staged_copy_as_the_sharded_mode_predicts():
    r = vc.dcp_views_case(TINY)
    assert r["measured"] == r["predicted"] > r["one_at_a_time"]
    assert r["retained"] == 0


def test_state_dicts_allocate_nothing():
    r = vc.state_dict_case(TINY)
    assert r["model"].spike == r["optimizer"].spike == 0


def test_the_validation_model_is_the_tiny_preset_with_sdpa():
    assert TINY.model_config() == replace(CFG, attention="sdpa")
