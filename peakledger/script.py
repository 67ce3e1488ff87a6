"""The user's own training script: predicted (run on fake tensors, recorded, simulated) and, on request, measured
(run for real on the CPU under the tracker) and held against the prediction.

`predict_script` is `api.run` for a script: models/script records it and turns the recording into an op graph,
the simulator runs it, analysis summarizes it, so the report is `simulate`'s (ledger, peaks by phase, first vs
steady, the caching allocator on a GPU profile, --check, plots and exports). What the script did (`Calls`), the
values it read that fake tensors could not give (stand-ins), and the versions of the libraries it ran are the
report's first lines: the loop is the script's, discovered, never assumed.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .analysis.device import with_gpu_oom
from .analysis.report import Report, summarize
from .analysis.validate import Validation, compare_logs
from .models.config import ConfigError
from .models.devices import device_profile
from .models.training import RANK_LIST_LIMIT
from .simulator.engine import simulate
from .simulator.events import Pool
from .simulator.run_metadata import RunMetadata
from .simulator.torch_rules import default_version

if TYPE_CHECKING:  # models/script imports torch: only a script's run loads it (a --hf-config repeat imports none)
    from .models.script import ScriptRecording

MEASURED_RANKS = 8  # --validate runs at most this many real processes (one per rank, gloo)


@dataclass(frozen=True)
class ScriptRun:
    """A script and how it is run: its path, its arguments, the optimizer steps to run (None: to its end), the
    device profile, the CUDA allocator rules' torch version and settings, the seconds it may run, and the world
    size a distributed script (torchrun's environment, `init_process_group`) runs at."""

    path: str
    argv: tuple[str, ...] = ()
    steps: int | None = 2
    device: str = "cpu"
    torch_version: str = field(default_factory=default_version)  # whose CUDA rules (simulator/torch_rules)
    alloc_conf: str = ""
    seconds: float | None = None
    world_size: int = 1
    name: str = field(default="")

    @property
    def title(self) -> str:
        return self.name or " ".join([Path(self.path).name, *self.argv])

    @property
    def recorded_ranks(self) -> list[int]:
        """The ranks recorded: rank 0, and the last rank of a world (whose shards of a dimension not divisible by
        the world size are the ones that differ); the others are rank 0's class."""
        return [0] if self.world_size == 1 else [0, self.world_size - 1]


def _signature(rec: ScriptRecording) -> tuple:
    """What makes two ranks' recordings one class: the same events of the same sizes in the same places."""
    return tuple((a, rec.storages[sid].nbytes, pos) for a, sid, _, pos, _ in rec.events)


def rank_classes(run: ScriptRun, recordings: dict[int, ScriptRecording]) -> dict[int, list[tuple[int, int]]]:
    """Each recorded rank and the ranks (as inclusive ranges) whose memory it stands for."""
    n = run.world_size
    if n == 1:
        return {0: [(0, 0)]}
    last = n - 1
    if _signature(recordings[0]) == _signature(recordings[last]):
        return {0: [(0, last)]}
    return {0: [(0, last - 1)], last: [(last, last)]}


def script_metadata(run: ScriptRun, rec: ScriptRecording, classes: dict[int, list[tuple[int, int]]]) -> RunMetadata:
    calls = vars(rec.calls)
    listed = {str(r): [k for a, b in spans for k in range(a, b + 1)]
              if sum(b - a + 1 for a, b in spans) <= RANK_LIST_LIMIT else None for r, spans in classes.items()}
    return RunMetadata(model=f"script {Path(run.path).name}", device=run.device, rank_classes=listed,
                       rank_class_ranges={str(r): [list(x) for x in spans] for r, spans in classes.items()},
                       steps=max(1, rec.calls.optimizer_steps),
                       describer="script (peakledger run: the script run as it is on fake tensors)",
                       torch_version=run.torch_version, alloc_conf=run.alloc_conf, empty_cache_before_save=False,
                       script={"path": run.path, "argv": list(run.argv), "steps_asked": run.steps, "calls": calls,
                               "stand_ins": rec.standins, "versions": rec.versions, "world_size": run.world_size,
                               "program": "CPU" if device_profile(run.device).is_cpu else
                               "CPU program with the GPU profile's rules (cuBLAS workspace, caching allocator)"})


def predict_script(run: ScriptRun, budget: int | None = None, stop_on_oom: bool = False) -> tuple[Report, object]:
    """The script predicted: (its report, its op graph). A distributed script is recorded once per rank class,
    each rank in its own forked process with torch's fake process group (models/script/run.py)."""
    from .models.script import check_script, record_script, script_graph
    from .models.script.child import in_children

    path = check_script(run.path)
    profile = device_profile(run.device)
    ranks = run.recorded_ranks
    recordings = dict(zip(ranks, in_children([(record_script, (path, list(run.argv), run.steps, run.seconds, r,
                                                                run.world_size)) for r in ranks])))
    classes = rank_classes(run, recordings)
    graph, ids = None, 0
    for r in classes:
        graph, ids = script_graph(recordings[r], profile, r, graph, ids)
    graph.metadata = script_metadata(run, recordings[0], classes).updated(device_capacity=budget)
    capacities = {(r, Pool.DEVICE): budget for r in classes} if budget is not None and not profile.is_cuda else None
    log = simulate(graph, capacities, stop_on_oom=stop_on_oom)
    if budget is not None and profile.is_cuda:
        log = with_gpu_oom(log, budget, stop_on_oom)
    return summarize(log, name=run.title), graph


def validate_script(run: ScriptRun, predicted: Report) -> list[Validation]:
    """The script run for real on the CPU under the tracker (traces/script_run.py), one forked process per rank
    (a distributed script: gloo, every rank, at most MEASURED_RANKS), each held against the rank of `predicted`
    that stands for it."""
    from .models.script import check_script
    from .models.script.child import in_children
    from .traces.script_run import measure_script

    if run.world_size > MEASURED_RANKS:
        raise ConfigError("world_size", f"--validate runs one real process per rank: at most {MEASURED_RANKS}, "
                                        f"got {run.world_size}; predict larger worlds without --validate")
    port = free_port()
    path = check_script(run.path)
    logs = in_children([(measure_script, (path, list(run.argv), run.steps, run.seconds, 1, r, run.world_size, port))
                        for r in range(run.world_size)])
    spans = predicted.log.metadata.rank_class_ranges
    out = []
    for r, measured in enumerate(logs):
        standing = next(int(k) for k, ranges in spans.items() if any(a <= r <= b for a, b in ranges))
        name = run.title + (f" (rank {r})" if run.world_size > 1 else "")
        out.append(compare_logs(measured, predicted.log, name, rank=r, simulated_rank=standing))
    return out


def with_args(argv: tuple[str, ...], change: list[str]) -> tuple[str, ...]:
    """The script's arguments with `change` applied (a fix that maps to the script's own knobs): each `--flag value`
    or `--flag=value` of `change` replaces that flag's value where the arguments have it, else is appended; a bare
    `--flag` is added once."""
    out = list(argv)
    k = 0
    while k < len(change):
        flag = change[k]
        if "=" in flag and flag.startswith("-"):
            flag, value = flag.split("=", 1)
            values = [value]
            k += 1
        elif k + 1 < len(change) and not change[k + 1].startswith("--"):
            values = [change[k + 1]]
            k += 2
        else:
            values = []
            k += 1
        at = next((i for i, a in enumerate(out) if a == flag or a.startswith(flag + "=")), None)
        if at is None:
            out += [flag, *values]
        elif out[at].startswith(flag + "="):
            out[at] = f"{flag}={values[0]}" if values else flag
        elif values and at + 1 < len(out) and not out[at + 1].startswith("--"):
            out[at + 1] = values[0]
        elif values:
            out[at + 1:at + 1] = values
    return tuple(out)


def free_port() -> int:
    """A TCP port nothing listens on now, for the measured ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
