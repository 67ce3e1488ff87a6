"""A run's memory on a CUDA device profile (simulator/device_memory.py, analysis/device.py, models/gpu.py): the
caching allocator under an event log, the device total, torch's OOM text, and explain's allocator fixes. Expected
numbers are worked out by hand from the allocator's rules in the comments."""

from __future__ import annotations

import json

import pytest

from peakledger import api, diagnosis
from peakledger.cli import main
from peakledger.models.config import TrainingSetup
from peakledger.models.devices import DEVICES
from peakledger.models.gpu import cublas_workspace_bytes, nccl_buffer_bytes
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.scenario import build_scenario
from peakledger.simulator.device_memory import device_memory, format_size, torch_oom_message
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Block, Category, Event, EventLog, Phase, Stream

MB = 1 << 20


def log_of(*steps: tuple[str, int, int]) -> EventLog:
    """("alloc" | "free", block id, bytes) in order, on rank 0's device."""
    events = []
    for i, (action, bid, nbytes) in enumerate(steps):
        blk = Block(id=bid, nbytes=nbytes, category=Category.TEMPORARY, name=f"t{bid}", dtype="fp32")
        events.append(Event(seq=i, time=float(i), action=Action(action), block=blk, phase=Phase.FORWARD, step=1,
                            micro_batch_index=0, stream=Stream.COMPUTE, op=f"op{i}"))
    return EventLog(events, "test")


def test_reserved_fragmentation_and_device_total_by_hand():
    log = log_of(("alloc", 1, 1000),  # 1024 B block of a new 2 MiB small segment
                 ("alloc", 2, 3 * MB),  # large pool, < 10 MiB: a new 20 MiB segment, 17 MiB split off
                 ("alloc", 3, 12 * MB),  # fits the 17 MiB remainder: no new segment
                 ("free", 2, 3 * MB),  # a 3 MiB hole before the 12 MiB block
                 ("alloc", 4, 4 * MB),  # best fit: the 5 MiB tail (17 - 12), not the 3 MiB hole; 1 MiB left, unsplit
                 ("alloc", 5, 0))  # a zero-byte tensor takes no block
    dm = device_memory(log, context=500 * MB, outside={"nccl": 8 * MB})
    assert dm.reserved_peak.reserved == 22 * MB and dm.segment_allocs == 2
    at = dm.at_allocated_peak  # after event 4: 1000 + 12 MiB + 4 MiB of tensors
    # in blocks: 1024 + 12 MiB + the whole 5 MiB tail (a large block is split only when more than 1 MiB is left)
    assert at.allocated == 1000 + 16 * MB and at.allocated_blocks == 1024 + 17 * MB
    assert at.fragmentation == 22 * MB - 1024 - 17 * MB and at.largest_free == 3 * MB  # the hole; the small rest
    assert dm.total_peak.total == 500 * MB + 8 * MB + 22 * MB


def test_retry_after_freeing_the_cache_then_torch_worded_oom():
    # capacity 60 MiB - 20 MiB context = 40 MiB for the allocator
    # >= 10 MiB: a segment of the request rounded up to 2 MiB; its 1 MiB rest is too small to split off
    steps = [("alloc", 1, 15 * MB), ("alloc", 2, 15 * MB),  # 16 MiB segments (and blocks) each
             ("free", 1, 15 * MB),  # cached: 16 MiB reserved, free
             ("alloc", 3, 17 * MB)]  # needs an 18 MiB segment: 32 + 18 > 40, so the cached 16 MiB go first
    dm = device_memory(log_of(*steps), capacity=60 * MB, context=20 * MB)
    assert dm.oom is None and dm.segment_frees == 1 and dm.reserved_peak.reserved == 34 * MB
    dm = device_memory(log_of(*steps, ("alloc", 4, 7 * MB)), capacity=60 * MB, context=20 * MB)
    # 7 MiB asks for a 20 MiB segment: 34 + 20 > 40 and no cached block is free: the OOM; in use 20 + 34 MiB,
    # all of the 34 MiB reserved is allocated (16 + 18 MiB blocks)
    assert dm.oom is not None and dm.oom.segment == 20 * MB and dm.oom.requested == 7 * MB
    assert dm.oom.message.startswith("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
                                     "of 60.00 MiB of which 6.00 MiB is free. Including non-PyTorch memory, this "
                                     "process has 54.00 MiB memory in use. Of the allocated memory 34.00 MiB is "
                                     "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")


def test_format_size_follows_torch():
    # c10/cuda/CUDACachingAllocator.cpp format_size: <= 1 KiB in bytes, then KiB, MiB, GiB with 2 decimals
    assert [format_size(n) for n in (1024, 1025, MB, MB + 1, 1 << 30, 3 << 30)] == \
        ["1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1024.00 MiB", "3.00 GiB"]
    assert "GPU 1 has" in torch_oom_message(MB, 1 << 30, 0, 0, 0, device=1)


def test_cublas_workspaces_by_compute_capability():
    # CublasHandlePool.cpp: ":4096:8" = 32 MiB on sm90, ":4096:2:16:8" = 8 MiB + 128 KiB elsewhere
    assert cublas_workspace_bytes((9, 0)) == 33_554_432 and cublas_workspace_bytes((8, 0)) == 8_519_680
    for device, size in (("H100-80GB", 33_554_432), ("A100-80GB", 8_519_680), ("cpu", None)):
        log = simulate(describe(preset("tiny"), TrainingSetup(micro_batch=2, seq_len=16, steps=2), device))
        ws = [(e.block.nbytes, e.phase, e.step) for e in log.events if e.block.category is Category.WORKSPACE]
        # one for the forward's thread, one for autograd's, at the first GEMM of each, never freed
        assert ws == ([] if size is None else [(size, Phase.FORWARD, 1), (size, Phase.BACKWARD, 1)])
    assert nccl_buffer_bytes(1) == 0 and nccl_buffer_bytes(8) == 2 * 16 * 4 * MB


def test_simulate_json_keeps_allocated_reserved_and_device_total_apart(capsys):
    assert main(["simulate", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    r, t, dm = d["reserved_peak"], d["device_total_peak"], d["device_memory"]
    assert d["peak"]["bytes"] <= dm["at_allocated_peak"]["allocated_blocks"] <= r["bytes"]
    assert t["bytes"] == r["bytes"] + DEVICES["H100-80GB"].context_bytes == d["capacity_needed"]
    assert {"op", "phase", "step"} <= set(r) and r["fragmentation"] == r["reserved"] - r["allocated_blocks"]
    rows = {row["row"]: row for row in dm["ledger_at_device_total_peak"]}
    assert sum(row["bytes"] for row in rows.values()) == t["bytes"] and rows["CUDA context and kernels"]["assumed"]
    assert main(["simulate", "--preset", "tiny", "--device", "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["reserved_peak"] is None and d["device_total_peak"] is None


def fragmented() -> tuple:
    """GPT-2 with 2 layers, micro-batch 4 x 256 tokens, and a budget between the allocated blocks (+ context) and
    the device total: the tensors fit, the cache's layout does not."""
    sc = build_scenario({"preset": "gpt2", "n_layer": 2}, {"micro_batch": 4, "seq_len": 256})
    g = api.run(sc).gpu
    low = g.context + g.at_allocated_peak.allocated_blocks
    return sc, low + (g.total_peak.total - low) // 3


def test_a_fragmentation_oom_is_named_and_expandable_segments_fixes_it():
    sc, budget = fragmented()
    report = api.run(sc)
    assert report.gpu.context + report.peaks.overall.bytes < budget < report.capacity_needed
    assert not api.fits(report, budget)
    x = diagnosis.explain(sc, budget)
    assert x.fragmentation and x.gpu_oom is not None and "CUDA out of memory" in x.gpu_oom.message
    first = x.fixes[0]
    assert first.changes == {"alloc_conf": "expandable_segments:True"} and first.fits and not first.changes_training
    assert api.fits(api.run(sc.with_changes(alloc_conf="expandable_segments:True")), budget)


def test_explain_cli_prints_torchs_oom_and_the_fix(capsys):
    sc, budget = fragmented()
    argv = ["explain", "--preset", "gpt2", "--n-layer", "2", "--micro-batch", "4", "--seq-len", "256",
            "--budget", str(budget)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "torch would say:" in out and "fragmentation:" in out and "allocator: expandable_segments:True" in out
    assert main(argv + ["--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu"]
    assert gpu["fragmentation"] and gpu["oom"]["message"].startswith("CUDA out of memory. Tried to allocate")


@pytest.mark.parametrize("flags,field", [(["--alloc-conf", "expandable_segments:maybe"], "alloc_conf"),
                                         (["--torch-version", "1.13"], "torch_version")])
def test_bad_gpu_settings_exit_2(capsys, flags, field):
    assert main(["simulate", "--preset", "tiny", *flags]) == 2
    assert capsys.readouterr().err.startswith(f"peakledger: error: {field}: ")
