"""What lies outside the caching allocator (models/cuda_context.py): the table against the measurement files it
cites (../shared/gpu-truth/h200), the residuals of the 20 measured H200 runs, the pick per device profile and torch
version, and the report's device total = that + reserved, labelled measured or assumed, in text and JSON. The
expected bytes are read from measured.json, never written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peakledger import api
from peakledger.analysis.device import context_of
from peakledger.analysis.report import assumptions, report_json, summarize
from peakledger.cli import main
from peakledger.models.config import TrainingSetup
from peakledger.models.cuda_context import (
    ASSUMED_ROW,
    CONTEXT_ROW,
    FSDP2_ROW,
    KERNELS_ROW,
    MEASURED,
    cuda_context,
    torch_minor,
)
from peakledger.models.devices import DEVICES
from peakledger.scenario import build_scenario
from peakledger.simulator.device_memory import device_memory

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
H200 = DEVICES["H200-141GB"]
(MEASUREMENT,) = [m for m in MEASURED if m.profile == "H200-141GB"]
TINY = ["--preset", "tiny", "--micro-batch", "2", "--seq-len", "16"]


@pytest.fixture(scope="module")
def measured() -> dict:
    path = ROOT / MEASUREMENT.source / "hf-runs" / "measured.json"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return json.loads(path.read_text())


def first_step_outside(run: dict) -> int:
    """What the driver counted as used but the allocator did not hold, after a run's first step."""
    step = run["steps"][0]
    return step["device_used"] - step["reserved_after"]


def processes(measured: dict) -> dict[str, list[str]]:
    """The runs of each process in run order: run_cases.py --set A, then --set A2 (names "a2-...")."""
    names = list(measured["cases"])
    return {"A": [n for n in names if not n.startswith("a2-")], "A2": [n for n in names if n.startswith("a2-")]}


def test_the_table_holds_what_the_files_say(measured):
    m = MEASUREMENT
    assert (m.gpu, list(m.compute_capability), m.torch) == (measured["gpu"], measured["capability"], measured["torch"])
    assert m.after_init == measured["context_used"] and m.after_first_gemm == measured["context_used_after_matmul"]
    runs = processes(measured)
    assert m.first_step_run == runs["A"][0] and m.fsdp2_run == runs["A2"][0]  # each the first of a fresh process
    assert measured["cases"][m.fsdp2_run]["options"] == {"fsdp2": True}
    assert m.after_first_step == first_step_outside(measured["cases"][m.first_step_run])
    assert m.fsdp2_after_first_step == first_step_outside(measured["cases"][m.fsdp2_run])
    readme = (ROOT / m.source / "README.md").read_text()
    assert f"driver {m.driver}" in readme and f"CUDA {m.cuda}" in readme and f"{m.after_init:,} B" in readme
    assert f"{m.after_first_gemm:,} B" in readme and all((ROOT / m.source / f).exists() for f in m.files)


def test_device_used_is_context_plus_reserved_run_by_run(measured):
    """device_used - (context + the step's kernels, + FSDP2's communicator once a run of the process used it) -
    reserved_after, per run and step: 0 for the first run of each process; later runs of a process hold the
    kernels of the runs before them, so the residual never falls, and stays within 10 MiB."""
    residuals = {}
    for runs in processes(measured).values():
        fsdp2_seen, before = False, 0
        for name in runs:
            run = measured["cases"][name]
            fsdp2_seen |= bool(run["options"].get("fsdp2"))
            setup = TrainingSetup(dp_engine="fsdp2", world_size=1) if fsdp2_seen else None
            outside = cuda_context(H200, measured["torch"], setup).bytes
            got = [s["device_used"] - outside - s["reserved_after"] for s in run["steps"]]
            assert len(got) == 2 and got[0] == got[1]  # step 2 loads nothing new
            assert before <= got[0] <= 10 * MiB
            residuals[name] = before = got[0]
        assert residuals[runs[0]] == 0
    print("\n".join(f"{n:<45}{r:>12,} B" for n, r in residuals.items()))
    names = list(measured["cases"])
    resnet = names.index("a2-resnet50-autocast-b64")
    assert residuals[names[resnet]] == residuals[names[resnet - 1]]  # cuDNN's convolutions add nothing outside
    assert len(residuals) == 20


def test_the_pick_per_profile_and_torch_version():
    ctx = cuda_context(H200, "2.11")
    assert ctx.measured and ctx.measurement is MEASUREMENT and ctx.label == \
        "measured: H200, torch 2.11+cu130, ../shared/gpu-truth/h200"
    assert ctx.parts == ((CONTEXT_ROW, MEASUREMENT.after_first_gemm), (KERNELS_ROW, MEASUREMENT.step_kernels))
    assert ctx.bytes == MEASUREMENT.after_first_step and cuda_context(H200, "2.11.0+cu130") == ctx
    fsdp2 = cuda_context(H200, "2.11", TrainingSetup(dp_engine="fsdp2", world_size=1))
    assert fsdp2.parts[-1] == (FSDP2_ROW, MEASUREMENT.fsdp2_extra) and fsdp2.bytes == MEASUREMENT.fsdp2_after_first_step
    eight = TrainingSetup(dp_engine="fsdp2", world_size=8)
    assert cuda_context(H200, "2.11", eight) == ctx  # not measured: NCCL assumed
    # the same architecture and torch version, another GPU: the H200's figures, labelled assumed
    h100 = cuda_context(DEVICES["H100-80GB"], "2.11")
    assert not h100.measured and h100.measurement is MEASUREMENT and h100.bytes == ctx.bytes
    assert h100.label.startswith("assumed: not measured for H100-80GB with torch 2.11; the H200, torch 2.11+cu130")
    # nothing measured for torch 2.6 (the H100 snapshots hold no free/total) nor for sm80: the profile's assumption
    for profile, version in ((DEVICES["H100-80GB"], "2.6"), (H200, "2.6"), (DEVICES["A100-80GB"], "2.11")):
        c = cuda_context(profile, version)
        assert not c.measured and c.measurement is None and c.parts == ((ASSUMED_ROW, profile.context_bytes),)
        assert c.label == f"assumed: not measured for {profile.name} with torch {version}"
    assert cuda_context(DEVICES["cpu"], "2.11") is None and torch_minor("2.11.0+cu130") == "2.11"
    assert DEVICES["H100-80GB"].assumptions()[-1].startswith("collectives")  # no torch version: no context line
    assert DEVICES["H100-80GB"].assumptions("2.6")[-1] == cuda_context(DEVICES["H100-80GB"], "2.6").assumption()


def run_json(capsys, *flags: str) -> dict:
    assert main(["simulate", *TINY, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_report_device_total_is_the_measured_context_plus_reserved(capsys, measured):
    d = run_json(capsys, "--device", "H200-141GB", "--torch-version", "2.11")
    r, t, dm = d["reserved_peak"], d["device_total_peak"], d["device_memory"]
    context = measured["context_used_after_matmul"]
    kernels = first_step_outside(measured["cases"][MEASUREMENT.first_step_run]) - context
    assert t["bytes"] == r["bytes"] + context + kernels == r["bytes"] + dm["context_bytes"] == d["capacity_needed"]
    c = dm["cuda_context"]
    assert c["measured"] and c["source"] == "../shared/gpu-truth/h200" and c["bytes"] == context + kernels
    assert c["measurement"]["torch"] == measured["torch"] and c["measurement"]["after_init"] == measured["context_used"]
    rows = {row["row"]: row for row in dm["ledger_at_device_total_peak"]}
    assert rows[CONTEXT_ROW]["bytes"] == context and rows[KERNELS_ROW]["bytes"] == kernels
    assert not rows[CONTEXT_ROW]["assumed"] and rows[CONTEXT_ROW]["source"] == c["source"]
    assert sum(row["bytes"] for row in rows.values()) == t["bytes"]
    assert any(a.endswith(c["measurement"]["source"] + "/hf-runs/measured.json)") for a in d["assumptions"])
    # the allocator's numbers do not depend on it: the same as a replay with nothing outside the allocator
    sc = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16}, {"device": "H200-141GB",
                                                                                "torch_version": "2.11"})
    bare = device_memory(api.run(sc).log, 0, "", None, 0, {}, torch_version="2.11")
    assert bare.reserved_peak.reserved == r["bytes"] and bare.at_allocated_peak.allocated == \
        dm["at_allocated_peak"]["allocated"]
    assert main(["simulate", *TINY, "--device", "H200-141GB", "--torch-version", "2.11"]) == 0
    out = capsys.readouterr().out
    assert (f"= CUDA context + cuBLAS {context / MiB:.1f} MiB (measured: H200, torch 2.11+cu130, "
            f"../shared/gpu-truth/h200) + kernels loaded by the training step {kernels / MiB:.1f} MiB") in out
    assert "(assumed" not in out.split("device total")[1].split("\n")[0]


def test_report_labels_what_is_assumed(capsys):
    d = run_json(capsys, "--torch-version", "2.6")  # H100-80GB, torch 2.6: nothing measured
    c = d["device_memory"]["cuda_context"]
    assert not c["measured"] and c["source"] is None and c["bytes"] == DEVICES["H100-80GB"].context_bytes
    assert d["device_total_peak"]["bytes"] == d["reserved_peak"]["bytes"] + c["bytes"]
    assert sum(a.startswith("outside the caching allocator: CUDA context and kernels") for a in d["assumptions"]) == 1
    assert main(["simulate", *TINY, "--torch-version", "2.6"]) == 0
    out = capsys.readouterr().out
    assert "= CUDA context and kernels 512.0 MiB (assumed: not measured for H100-80GB with torch 2.6) + reserved" in out
    d = run_json(capsys, "--torch-version", "2.11")  # H100 with 2.11: the H200's figures, assumed
    c = d["device_memory"]["cuda_context"]
    assert not c["measured"] and c["source"] == MEASUREMENT.source and c["bytes"] == MEASUREMENT.after_first_step
    assert all(row["assumed"] for row in d["device_memory"]["ledger_at_device_total_peak"][3:])


def test_fsdp2_on_one_rank_adds_the_measured_communicator(capsys):
    base = run_json(capsys, "--device", "H200-141GB", "--torch-version", "2.11")
    d = run_json(capsys, "--device", "H200-141GB", "--torch-version", "2.11", "--dp-engine", "fsdp2",
                 "--world-size", "1")
    assert d["device_memory"]["context_bytes"] == base["device_memory"]["context_bytes"] + MEASUREMENT.fsdp2_extra
    assert d["device_total_peak"]["bytes"] == d["reserved_peak"]["bytes"] + MEASUREMENT.fsdp2_after_first_step
    two = run_json(capsys, "--device", "H200-141GB", "--torch-version", "2.11", "--dp-engine", "fsdp2",
                   "--world-size", "2")
    dm = two["device_memory"]  # more ranks: NCCL's buffers, assumed (models/gpu.py), no world-size-1 figure
    assert dm["context_bytes"] == MEASUREMENT.after_first_step and dm["outside_allocator"]["nccl"] > 0


def test_an_older_log_gets_the_context_line_of_its_torch_version():
    sc = build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16}, {"device": "H200-141GB"})
    log = api.run(sc).log
    log.metadata = log.metadata.updated(assumptions=log.metadata.assumptions + [
        "CUDA context and kernels 512 MiB outside the caching allocator (assumed; sm90)"],
        torch_version="2.11.0+cu130")  # a measured log's own torch.__version__
    report = summarize(log)
    lines = assumptions(report)
    assert not any(a.startswith("CUDA context and kernels") for a in lines) and lines[-1] == \
        context_of(log).assumption() and context_of(log).measured
    assert report_json(report)["assumptions"] == lines
    assert report.gpu.total_peak.total == report.gpu.reserved_peak.reserved + MEASUREMENT.after_first_step
