"""The user's own training script: predicted (run on fake tensors, recorded, simulated) and, on request, measured
(run for real on the CPU under the tracker) and held against the prediction.

`predict_script` is `api.run` for a script: models/script records it and turns the recording into an op graph,
the simulator runs it, analysis summarizes it, so the report is `simulate`'s (ledger, peaks by phase, first vs
steady, the caching allocator on a GPU profile, --check, plots and exports). What the script did (`Calls`), the
values it read that fake tensors could not give (stand-ins), and the versions of the libraries it ran are the
report's first lines: the loop is the script's, discovered, never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .analysis.device import with_gpu_oom
from .analysis.report import Report, summarize
from .analysis.validate import Validation, compare_logs
from .models.costs import device_profile
from .models.script import ScriptRecording, check_script, record_script, script_graph
from .models.script.child import in_child
from .simulator.engine import simulate
from .simulator.events import Pool


@dataclass(frozen=True)
class ScriptRun:
    """A script and how it is run: its path, its arguments, the optimizer steps to run (None: to its end), the
    device profile, the CUDA allocator rules' torch version and settings, the seconds it may run."""

    path: str
    argv: tuple[str, ...] = ()
    steps: int | None = 2
    device: str = "cpu"
    torch_version: str = "2.6"
    alloc_conf: str = ""
    seconds: float | None = None
    name: str = field(default="")

    @property
    def title(self) -> str:
        return self.name or " ".join([Path(self.path).name, *self.argv])


def script_metadata(run: ScriptRun, rec: ScriptRecording) -> dict:
    calls = vars(rec.calls)
    return {"model": f"script {Path(run.path).name}", "device": run.device, "rank_classes": {"0": [0]},
            "rank_class_ranges": {"0": [[0, 0]]}, "steps": max(1, rec.calls.optimizer_steps),
            "describer": "script (peakledger run: the script run as it is on fake tensors)",
            "torch_version": run.torch_version, "alloc_conf": run.alloc_conf, "empty_cache_before_save": False,
            "script": {"path": run.path, "argv": list(run.argv), "steps_asked": run.steps, "calls": calls,
                       "stand_ins": rec.standins, "versions": rec.versions,
                       "program": "CPU" if device_profile(run.device).is_cpu else
                       "CPU program with the GPU profile's rules (cuBLAS workspace, caching allocator)"}}


def predict_script(run: ScriptRun, budget: int | None = None, stop_on_oom: bool = False) -> tuple[Report, object]:
    """The script predicted: (its report, its op graph)."""
    path = check_script(run.path)
    profile = device_profile(run.device)
    rec = in_child(record_script, path, list(run.argv), run.steps, run.seconds)
    graph = script_graph(rec, profile)
    graph.metadata.update(script_metadata(run, rec), device_capacity=budget)
    capacities = {(0, Pool.DEVICE): budget} if budget is not None and not profile.is_cuda else None
    log = simulate(graph, capacities, stop_on_oom=stop_on_oom)
    if budget is not None and profile.is_cuda:
        log = with_gpu_oom(log, budget, stop_on_oom)
    return summarize(log, name=run.title), graph


def validate_script(run: ScriptRun, predicted: Report) -> Validation:
    """The script run for real on the CPU under the tracker (traces/script_run.py), in a child forked from this
    process as the prediction's was (models/script/child.py), held against `predicted`."""
    from .traces.script_run import measure_script

    measured = in_child(measure_script, check_script(run.path), list(run.argv), run.steps, run.seconds)
    return compare_logs(measured, predicted.log, run.title)
