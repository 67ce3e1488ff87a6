"""GPU validation: real training steps on a CUDA GPU, recorded as CUDA memory snapshots, against peakledger's
predictions of the same runs on the device profile of that GPU. Writes "## GPU validation: recorded snapshots vs
predictions" of bench/VALIDATION.md.

    python bench/validate_gpu.py [--write] [--json] [--output-dir traces/data/gpu] [--limit-seconds 480]
    python bench/validate_gpu.py --dry-run                   # the matrix, each run's predicted sizes; no GPU needed
    python bench/validate_gpu.py --from-snapshots traces/data/gpu [--write]   # recorded runs compared again, anywhere
    python bench/validate_gpu.py --only cs336-small          # the runs whose label holds the text

On a machine without CUDA (`torch.cuda.is_available()` false) it records nothing, says so, and exits 0 (with
--write the section says it has not run on a GPU yet; a section that holds results is kept).

The matrix (`all_configs`): the tiny GPT-2, tiny Llama and tiny MLP presets (hand-written describers) and the CS336
TransformerLM of the shared GPU snapshots at d_model 64 and at the author's "small" size
(examples/modules/cs336_lm.py:tiny_factory / small_factory, traced describer); fp32, bf16 autocast and pure bf16;
AdamW foreach and for-loop; activation checkpointing none and full; passes train (2 steps) and forward (one
`out = model(batch)` with autograd on, then dropped): 68 runs, sized for under 8 minutes on one H100 (an estimate,
not yet measured; --limit-seconds stops starting runs after that).

Each run, in this process: every tensor of the previous run dropped, cuBLAS workspaces cleared, the allocator's
cache emptied (so the run starts from an empty allocator, as a fresh process and the simulation do); then
`torch.cuda.memory._record_memory_history(max_entries=...)` from before the model reaches the GPU, the model
moved (presets) or built (traced models, under `torch.device("cuda")`) on the device, the loop of
traces/cuda_capture.py (each micro-batch copied in; forward, loss, backward; optimizer step; zero_grad), then
`_dump_snapshot` (gzip'd into --output-dir, with manifest.json naming every run, the GPU and torch). The
prediction is `peakledger.api.run` of the same scenario on the profile of the GPU's compute capability (9.0:
H100-80GB, 8.0: A100-80GB; another GPU is recorded but not predicted), with the caching-allocator rules of the
torch that ran (its own release's when modelled, else the newest modelled not newer).

Compared (`compare_run`): allocated peak (highest sum of live requested bytes) and reserved peak
(bench/gpu_snapshots.py `measured_peaks`, as bench/validate_gpu_truth.py reads the shared snapshots), and event by
event. Per event the k-th allocation of each size in the snapshot is paired with the k-th allocation of that size
in the simulated log (`align_by_size`), and the reserved (and allocated) bytes right after the two are compared.
Pairing by position would shift every later pair after one allocation that only one side makes (a CUDA kernel's
workspace, a cast the CPU-traced program does not make), so one difference would count as hundreds; pairing by
size keeps every allocation the two share in step, and the ones of a size one side makes more often stay
unpaired and are counted. Because the order of the program can still differ a little, the segments (each
cudaMalloc's size) are also compared as sorted lists (`compare_segments`): order-free, it says whether the
allocator reserved the same segments at all. And each snapshot's own allocation sequence is replayed through the
allocator model (bench/gpu_snapshots.py `allocator_replay`), with the model's segment addresses and with the ones
cudaMalloc returned: a reserved peak the replay at the recorded addresses reproduces but the prediction misses comes
from the predicted program, or from where the driver placed segments (best fit breaks ties by address), not from
the allocator's rules.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import gzip
import itertools
import json
import sys
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
from gpu_snapshots import allocator_replay, measured_peaks, read_raw_snapshot  # noqa: E402
from sections import VALIDATION, replace_section  # noqa: E402

from peakledger import api  # noqa: E402
from peakledger.analysis.device import gpu_memory  # noqa: E402
from peakledger.scenario import build_scenario  # noqa: E402
from peakledger.simulator.events import Action, EventLog, Pool  # noqa: E402
from peakledger.simulator.safe_io import write_atomic  # noqa: E402
from peakledger.traces.cuda_capture import allocator_rules as capture_rules  # noqa: E402
from peakledger.traces.cuda_snapshot import parse_snapshot  # noqa: E402

SECTION = "## GPU validation: recorded snapshots vs predictions"
NO_GPU = "no CUDA GPU on this machine: bench/validate_gpu.py records nothing here"
RESULTS_MARK = "Recorded on "  # the first words of a section that holds results (kept by a run without a GPU)
ROOT = BENCH.parent
DEFAULT_OUTPUT = ROOT / "traces" / "data" / "gpu"
MANIFEST = "manifest.json"
CS336 = ROOT / "examples" / "modules" / "cs336_lm.py"
PROFILES = {(9, 0): "H100-80GB", (8, 0): "A100-80GB"}  # compute capability -> peakledger device profile
TARGETS = {"allocated": 0.01, "reserved": 0.02}
LIMIT_SECONDS = 480
MODELS = {"tiny": {"preset": "tiny"}, "tiny-llama": {"preset": "tiny-llama"}, "tiny-mlp": {"preset": "tiny-mlp"},
          "cs336-tiny": {"module": f"{CS336}:tiny_factory"}, "cs336-small": {"module": f"{CS336}:small_factory"}}
TRAIN_PRECISIONS = {"tiny": ("fp32", "bf16-autocast", "bf16"), "tiny-llama": ("fp32", "bf16"),
                    "tiny-mlp": ("fp32", "bf16-autocast", "bf16"), "cs336-tiny": ("fp32", "bf16-autocast", "bf16"),
                    "cs336-small": ("fp32", "bf16-autocast")}
IMPLS = ("foreach", "for-loop")
CHECKPOINTING = ("none", "full")


# -- the matrix ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GpuConfig:
    model: str  # a key of MODELS
    precision: str
    impl: str = "foreach"  # AdamW's optimizer_impl
    checkpointing: str = "none"
    passes: str = "train"
    attention: str | None = None  # transformer presets: eager or sdpa
    micro_batch: int = 4
    seq_len: int | None = 64  # None: the model has no sequence (MLP)

    @property
    def steps(self) -> int:
        return 2 if self.passes == "train" else 1

    @property
    def label(self) -> str:
        parts = [self.model] + ([self.attention] if self.attention else [])
        size = f"B={self.micro_batch}" + (f" T={self.seq_len}" if self.seq_len else "")
        parts += [self.precision, f"adamw ({self.impl})" if self.passes == "train" else "forward only",
                  f"ckpt={self.checkpointing}", size]
        return ", ".join(parts)

    @property
    def slug(self) -> str:
        parts = [self.model] + ([self.attention] if self.attention else [])
        parts += [self.precision, self.impl if self.passes == "train" else "fwd", f"ckpt-{self.checkpointing}",
                  f"b{self.micro_batch}" + (f"t{self.seq_len}" if self.seq_len else "")]
        return "-".join(parts)

    def scenario(self, device: str = "H100-80GB", torch_version: str = "2.6"):
        model = dict(MODELS[self.model])
        if self.attention:
            model.update(attention=self.attention, max_seq_len=max(64, self.seq_len or 0))
        training = {"micro_batch": self.micro_batch, "steps": self.steps, "precision": self.precision,
                    "optimizer": "adamw", "optimizer_impl": self.impl, "checkpointing": self.checkpointing,
                    "passes": self.passes}
        if self.seq_len is not None:
            training["seq_len"] = self.seq_len
        return build_scenario(model, training, {"device": device, "torch_version": torch_version}, name=self.label)


def all_configs() -> list[GpuConfig]:
    out: list[GpuConfig] = []
    for model, precisions in TRAIN_PRECISIONS.items():
        size = ({"micro_batch": 32, "seq_len": None} if model == "tiny-mlp" else
                {"micro_batch": 4, "seq_len": 128} if model.startswith("cs336") else {"micro_batch": 4, "seq_len": 64})
        attention = "eager" if model in ("tiny", "tiny-llama") else None
        for precision, impl, ckpt in itertools.product(precisions, IMPLS, CHECKPOINTING):
            out.append(GpuConfig(model, precision, impl, ckpt, "train", attention, **size))
        for precision in precisions:
            out.append(GpuConfig(model, precision, "foreach", "none", "forward", attention, **size))
        if model == "tiny":  # torch's SDPA picks a CUDA kernel (flash / efficient) the CPU path does not run
            out += [GpuConfig(model, p, "foreach", "none", "train", "sdpa", **size) for p in precisions]
    return out


def select(configs: list[GpuConfig], only: list[str] | None) -> list[GpuConfig]:
    return [c for c in configs if not only or any(text in c.label or text == c.slug for text in only)]


# -- the comparison ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AllocPoint:
    """One allocation and the device right after it: tensor bytes live, bytes the allocator reserves.
    `timed`: False for a block the snapshot found live at record start (allocated before the trace: when, and what
    was reserved then, is unknown), which counts for the pairing by size but is not compared."""

    nbytes: int
    allocated: int
    reserved: int
    timed: bool = True


def measured_points(trace) -> tuple[list[AllocPoint], list[int]]:
    """A snapshot trace (traces/cuda_snapshot/parse.py SnapshotTrace) as (its allocations in order, with allocated and
    reserved after each; the sizes of the segments the program held). Both views are walked together in the
    order of the trace (their `seq`). Segments: every segment_alloc of the trace and each segment live at record
    start that the trace's opening empty_cache() does not release (bench/gpu_snapshots.py)."""
    merged = sorted([(e.seq, 0, e) for e in trace.allocated.events] + [(e.seq, 1, e) for e in trace.reserved.events],
                    key=lambda x: x[0])
    points: list[AllocPoint] = []
    allocated = reserved = 0
    opened = False
    segments: dict[int, int] = {}  # block id -> bytes, the program's segments
    for _, view, e in merged:
        if view == 1:
            reserved += e.delta
            if e.op != "pre-existing" and not (e.action is Action.FREE and not opened):
                opened = True
            if e.action is Action.ALLOC:
                segments[e.block.id] = e.block.nbytes
            elif not opened:
                segments.pop(e.block.id, None)  # released by the opening empty_cache(): not this program's
            continue
        allocated += e.delta
        if e.action is Action.ALLOC and e.block.nbytes > 0:
            points.append(AllocPoint(e.block.nbytes, allocated, reserved, e.op != "pre-existing"))
    return points, list(segments.values())


def predicted_points(log: EventLog, rank: int = 0) -> tuple[list[AllocPoint], list[int], object]:
    """A simulated log's allocations on `rank`'s device (zero-byte tensors take no block) with allocated and
    reserved after each, as the caching-allocator model sees them (analysis/device.py `gpu_memory`, series per
    event); the segment sizes (each rise of reserved: one malloc makes at most one cudaMalloc when no capacity
    is set, and nothing frees a segment without an empty_cache); and the DeviceMemory. None on a CPU profile."""
    dm = gpu_memory(log, rank, series=True)
    if dm is None:
        return [], [], None
    events = [e for e in log.events if e.block.rank == rank and e.block.pool is Pool.DEVICE]
    if dm.oom is None and len(events) != len(dm.series):
        raise ValueError(f"{len(dm.series)} allocator states for {len(events)} device events of rank {rank}")
    points, segments, before = [], [], 0
    for e, (_, allocated, reserved) in zip(events, dm.series):
        if reserved > before:
            segments.append(reserved - before)
        before = reserved
        if e.action is Action.ALLOC and e.block.nbytes > 0:
            points.append(AllocPoint(e.block.nbytes, allocated, reserved))
    return points, segments, dm


def align_by_size(measured: list[int], predicted: list[int]) -> list[tuple[int, int]]:
    """(i, j) pairs: the k-th allocation of each size on one side with the k-th of that size on the other, in
    the measured order. Sizes one side allocates more often leave its later ones unpaired."""
    where: dict[int, list[int]] = {}
    for j, size in enumerate(predicted):
        where.setdefault(size, []).append(j)
    seen: Counter = Counter()
    pairs = []
    for i, size in enumerate(measured):
        k = seen[size]
        seen[size] += 1
        if k < len(where.get(size, ())):
            pairs.append((i, where[size][k]))
    return pairs


def compare_events(measured: list[AllocPoint], predicted: list[AllocPoint]) -> dict:
    """Allocated and reserved right after every paired allocation (`align_by_size`), timed ones only: how many
    are equal, how many within 2% of the measured value, the mean and largest gap, and where the largest is."""
    paired = align_by_size([p.nbytes for p in measured], [p.nbytes for p in predicted])
    pairs = [(i, j) for i, j in paired if measured[i].timed]
    out = {"measured_allocs": len(measured), "predicted_allocs": len(predicted), "paired": len(paired),
           "compared": len(pairs)}
    for key in ("reserved", "allocated"):
        diffs = [(getattr(predicted[j], key) - getattr(measured[i], key), i, j) for i, j in pairs]
        worst = max(diffs, key=lambda d: (abs(d[0]), -d[1]), default=None)
        out[key] = {"equal": sum(d == 0 for d, _, _ in diffs),
                    "within_2pct": sum(abs(d) <= 0.02 * getattr(measured[i], key) for d, i, _ in diffs),
                    "mean_abs_diff": sum(abs(d) for d, _, _ in diffs) / len(diffs) if diffs else 0.0,
                    "max_abs_diff": abs(worst[0]) if worst else 0,
                    "worst": None if worst is None or worst[0] == 0 else {
                        "measured_alloc": worst[1], "predicted_alloc": worst[2], "size": measured[worst[1]].nbytes,
                        "measured": getattr(measured[worst[1]], key), "predicted": getattr(predicted[worst[2]], key)}}
    return out


def compare_segments(measured: list[int], predicted: list[int], show: int = 5) -> dict:
    """The segment sizes as sorted lists (multisets): how many are the same, and the largest ones only one side has."""
    cm, cp = Counter(measured), Counter(predicted)
    only_m, only_p = sorted((cm - cp).elements(), reverse=True), sorted((cp - cm).elements(), reverse=True)
    return {"measured": len(measured), "predicted": len(predicted), "same": sum((cm & cp).values()),
            "measured_bytes": sum(measured), "predicted_bytes": sum(predicted),
            "only_measured": only_m[:show], "only_measured_count": len(only_m),
            "only_predicted": only_p[:show], "only_predicted_count": len(only_p)}


def peak_errors(measured: dict, predicted: dict) -> dict:
    """predicted / measured - 1 for each of allocated and reserved (None where the measured one is 0)."""
    return {k: (predicted[k] / measured[k] - 1 if measured[k] else None) for k in TARGETS}


def compare_run(trace, report) -> dict:
    """One recorded snapshot trace against a report of the same scenario (`peakledger.api.run`)."""
    m_points, m_segments = measured_points(trace)
    rank = report.gpu.rank if report.gpu is not None else 0
    p_points, p_segments, dm = predicted_points(report.log, rank)
    measured = measured_peaks(trace)
    out = {"measured": measured, "truncated": trace.truncated,
           "preexisting_bytes": trace.preexisting_bytes, "preexisting_reserved": trace.preexisting_reserved}
    if dm is None:
        return {**out, "note": "the report is of a CPU profile: no allocator to compare"}
    predicted = {"allocated": report.peaks.overall.bytes, "reserved": dm.reserved_peak.reserved}
    error = peak_errors(measured, predicted)
    return {**out, "predicted": predicted, "error": error,
            "within_target": {k: error[k] is not None and abs(error[k]) <= tol for k, tol in TARGETS.items()},
            "events": compare_events(m_points, p_points), "segments": compare_segments(m_segments, p_segments)}


# -- the device ----------------------------------------------------------------------------------------------

def allocator_rules(torch_version: str) -> str:
    """The rules of the torch that ran: traces/cuda_capture.py `allocator_rules` ("2.12.1" -> "2.11")."""
    return capture_rules(torch_version)


def cuda_device() -> dict | None:
    """The GPU this process sees (device 0), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    cc = tuple(torch.cuda.get_device_capability(0))
    return {"name": torch.cuda.get_device_name(0), "compute_capability": list(cc), "profile": PROFILES.get(cc),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "allocator_rules": allocator_rules(torch.__version__),
            "total_memory": torch.cuda.get_device_properties(0).total_memory}


def clean_device() -> int:
    """Drop what the previous run left: garbage, cuBLAS workspaces (they stay in the allocator otherwise), the
    allocator's cache. The bytes still reserved (0 when the run starts clean)."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


# each loop phase in a function of its own, named as traces/cuda_capture.py names them (the snapshot loader's
# phase heuristic reads the Python frames)
def _peakledger_forward(model, batch):
    return model(*batch)


def _peakledger_forward_only(model, batch, traced: bool):
    if traced:  # the module's own forward, without the loss traces/reference/traced.py real_model adds
        return type(model).forward(model, *batch)
    return model(batch[0])[0]  # presets: model(x) -> (output, None)


def _peakledger_backward(loss):
    loss.backward()


def _peakledger_optimizer_step(optimizer):
    optimizer.step()


def _peakledger_zero_grad(optimizer):
    optimizer.zero_grad(set_to_none=True)


def build_on(scenario, device: str = "cuda") -> tuple:
    """(model, optimizer or None, batches, traced) of `scenario` on `device`. Presets: the reference model built on
    the host and moved, the batches left on the host (`run_loop` copies each micro-batch in, as the CPU tracker's
    loop clones it). Traced models: built under `torch.device(device)`, as the loss closes over the factory's batch,
    which must be there too (traces/reference/traced.py real_model)."""
    from peakledger.models.traced.model import TracedModel
    from peakledger.traces.cuda_capture import place_model
    from peakledger.traces.reference import make_optimizer

    setup = scenario.setup
    traced = isinstance(scenario.model, TracedModel)
    model, batches = place_model(scenario.model, setup, device)
    optimizer = make_optimizer(model, setup) if setup.batch.passes == "train" else None
    return model, optimizer, batches, traced


def run_loop(model, optimizer, batches, setup, traced: bool, device: str = "cuda") -> None:
    """The loop of traces/cuda_capture.py: per step, each micro-batch copied in (a clone of one already there),
    forward and loss (bf16 autocast on `device` where the precision says so), backward, the batch dropped; then the
    optimizer step and zero_grad(set_to_none). Passes "forward": `out = model(batch)` with autograd on, dropped."""
    import torch

    autocast = setup.precision.name == "bf16-autocast"
    for step in range(setup.batch.steps):
        for mb in range(setup.batch.grad_accum):
            src = batches[(step * setup.batch.grad_accum + mb) % len(batches)]
            batch = tuple(t.clone() if t.device.type == device else t.to(device) for t in src)
            loss = None
            with torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                if setup.batch.passes == "forward":
                    out = _peakledger_forward_only(model, batch, traced)
                else:
                    out, loss = _peakledger_forward(model, batch)
            if loss is not None:
                _peakledger_backward(loss)
            del out, loss, batch
        if optimizer is not None:
            _peakledger_optimizer_step(optimizer)
            _peakledger_zero_grad(optimizer)


def record_run(scenario, path: Path, max_entries: int, stacks: str = "python") -> dict:
    """Run `scenario` for real on cuda:0 under the allocator's history, from an empty allocator and from before the
    model reaches the device, and write the snapshot, gzip'd, to `path`. `stacks`: "python" (each allocation's
    Python stack: small files), "all" (C++ frames too) or "none"."""
    import torch

    start_reserved = clean_device()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    raw = path.with_name(path.name + ".tmp")
    torch.cuda.memory._record_memory_history(max_entries=max_entries, context=None if stacks == "none" else "alloc",
                                             stacks="all" if stacks == "all" else "python", clear_history=True)
    try:
        model, optimizer, batches, traced = build_on(scenario, "cuda")
        run_loop(model, optimizer, batches, scenario.setup, traced, "cuda")
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(raw))  # the model and its states still live, as in the simulation
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        model = optimizer = batches = None
    seconds = time.perf_counter() - t0
    data = raw.read_bytes()
    raw.unlink()
    write_atomic(path, gzip.compress(data, mtime=0))
    clean_device()
    return {"start_reserved": start_reserved, "run_seconds": round(seconds, 2), "pickle_bytes": len(data)}


# -- running the matrix --------------------------------------------------------------------------------------

def predict(config: GpuConfig, device: dict) -> tuple[object, object]:
    scenario = config.scenario(device["profile"] or "H100-80GB", device["allocator_rules"])
    return scenario, api.run(scenario)


def max_entries_for(report) -> int:
    """Room for four times the simulated device events (allocs, frees, segments) and a floor: never near the limit."""
    n = sum(1 for e in report.log.events if e.block.pool is Pool.DEVICE)
    return max(100_000, 4 * n + 10_000)


def run_matrix(configs: list[GpuConfig], device: dict, out_dir: Path, limit: float, log=print,
               stacks: str = "python") -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    manifest = {"format": "peakledger-gpu-validation", "version": 1, "device": device, "runs": []}
    with contextlib.suppress(OSError, ValueError, KeyError):  # runs recorded earlier on the same GPU and torch stay
        old = json.loads((out_dir / MANIFEST).read_text())
        if all(old["device"].get(k) == device.get(k) for k in ("name", "compute_capability", "torch")):
            manifest["runs"] = [r for r in old["runs"] if r["config"] not in [dataclasses.asdict(c) for c in configs]]
    for c in configs:
        row = {"config": dataclasses.asdict(c), "label": c.label, "snapshot": f"{c.slug}.pickle.gz"}
        if time.perf_counter() - t0 > limit:
            rows.append({**row, "skipped": f"--limit-seconds {limit:g} reached"})
            continue
        try:
            scenario, report = predict(c, device)
            row.update(record_run(scenario, out_dir / row["snapshot"], max_entries_for(report), stacks))
            manifest["runs"].append({k: row[k] for k in ("config", "snapshot", "start_reserved")})
            write_atomic(out_dir / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
            raw = read_raw_snapshot(out_dir / row["snapshot"])
            row.update(compare_run(parse_snapshot(raw, 0), report))
            row["allocator_replay"] = allocator_replay(raw, device["allocator_rules"])
            if device["profile"] is None:  # recorded, not predicted
                for k in ("predicted", "error", "within_target", "events", "segments"):
                    row.pop(k, None)
                row["note"] = f"compute capability {device['compute_capability']} has no peakledger device profile"
        except Exception as e:  # one failing run (an OOM, an op CUDA refuses) does not stop the matrix
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
        log(line(row))
    return rows


def from_snapshots(folder: Path, only: list[str] | None, log=print) -> tuple[dict, list[dict]]:
    """Runs recorded earlier (--output-dir with its manifest.json) compared again: no GPU needed."""
    manifest = json.loads((folder / MANIFEST).read_text())
    device = manifest["device"]
    rows = []
    for run in manifest["runs"]:
        c = GpuConfig(**run["config"])
        if only and c not in select([c], only):
            continue
        row = {"config": run["config"], "label": c.label, "snapshot": run["snapshot"],
               "start_reserved": run.get("start_reserved", 0)}
        try:
            raw = read_raw_snapshot(folder / run["snapshot"])
            trace = parse_snapshot(raw, 0)
            if device.get("profile") is None:
                row.update({"measured": measured_peaks(trace), "note": "no peakledger device profile for this GPU"})
            else:
                row.update(compare_run(trace, predict(c, device)[1]))
            row["allocator_replay"] = allocator_replay(raw, device["allocator_rules"])
        except Exception as e:
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
        log(line(row))
    return device, rows


def dry_run(configs: list[GpuConfig], device: dict | None, log=print) -> list[dict]:
    """What a GPU run would do: every config with the predicted peaks and the trace size it expects."""
    import torch

    profile = (device or {}).get("profile") or "H100-80GB"
    rules = (device or {}).get("allocator_rules") or allocator_rules(torch.__version__)
    rows = []
    for c in configs:
        try:
            report = api.run(c.scenario(profile, rules))
            device_events = [e for e in report.log.events if e.block.pool is Pool.DEVICE]
            frees = sum(e.action is Action.FREE for e in device_events)
            entries = len(device_events) + frees + report.gpu.segment_allocs  # a free: free_requested + completed
            rows.append({"label": c.label, "snapshot": f"{c.slug}.pickle.gz", "profile": profile,
                         "predicted": {"allocated": report.peaks.overall.bytes,
                                       "reserved": report.gpu.reserved_peak.reserved},
                         "trace_entries": entries, "max_entries": max_entries_for(report)})
        except Exception as e:
            rows.append({"label": c.label, "failed": f"{type(e).__name__}: {e}"})
        r = rows[-1]
        if "failed" in r:
            log(f"{c.label}: {r['failed']}")
            continue
        p = r["predicted"]
        log(f"{c.label}: allocated {p['allocated']:,} B, reserved {p['reserved']:,} B, ~{r['trace_entries']:,} trace "
            f"entries (max_entries {r['max_entries']:,})")
    return rows


# -- output --------------------------------------------------------------------------------------------------

def _pct(x) -> str:
    return "-" if x is None else f"{x:+.2%}"


def line(row: dict) -> str:
    if "skipped" in row or "failed" in row:
        return f"{row['label']}: {row.get('skipped') or 'failed: ' + row['failed']}"
    m = row["measured"]
    if "predicted" not in row:
        return f"{row['label']}: measured allocated {m['allocated']:,} B, reserved {m['reserved']:,} B ({row['note']})"
    p, e, ev = row["predicted"], row["error"], row["events"]
    return (f"{row['label']}: allocated {m['allocated']:,} / {p['allocated']:,} B ({_pct(e['allocated'])}), reserved "
            f"{m['reserved']:,} / {p['reserved']:,} B ({_pct(e['reserved'])}); reserved equal after "
            f"{ev['reserved']['equal']}/{ev['compared']} paired allocs")


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | allocs measured / predicted / paired | allocated peak measured / predicted (B) | error | "
             "reserved peak measured / predicted (B) | error | reserved after paired allocs: equal / within 2% / "
             "compared | largest reserved gap (B) | segments same / measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "failed" in r:
            lines.append(f"| {r['label']} | {r.get('skipped') or 'failed: ' + r['failed']} | | | | | | | |")
            continue
        m = r["measured"]
        if "predicted" not in r:
            lines.append(f"| {r['label']} | not predicted: {r['note']} | {m['allocated']:,} / - | - | "
                         f"{m['reserved']:,} / - | - | - | - | - |")
            continue
        p, e, ev, s = r["predicted"], r["error"], r["events"], r["segments"]
        lines.append(f"| {r['label']} | {ev['measured_allocs']} / {ev['predicted_allocs']} / {ev['paired']} | "
                     f"{m['allocated']:,} / {p['allocated']:,} | {_pct(e['allocated'])} | {m['reserved']:,} / "
                     f"{p['reserved']:,} | {_pct(e['reserved'])} | {ev['reserved']['equal']} / "
                     f"{ev['reserved']['within_2pct']} / {ev['compared']} | "
                     f"{ev['reserved']['max_abs_diff']:,} | {s['same']} / {s['measured']} / {s['predicted']} |")
    return lines


def summary(rows: list[dict]) -> str:
    done = [r for r in rows if "predicted" in r]
    ok = {k: sum(r["within_target"][k] for r in done) for k in TARGETS}
    equal = sum(r["events"]["reserved"]["equal"] for r in done)
    close = sum(r["events"]["reserved"]["within_2pct"] for r in done)
    compared = sum(r["events"]["compared"] for r in done)
    other = len(rows) - len(done)
    return (f"allocated peak within 1%: {ok['allocated']}/{len(done)}; reserved peak within 2%: {ok['reserved']}/"
            f"{len(done)}; reserved equal after {equal:,} and within 2% after {close:,} of {compared:,} paired "
            "allocations"
            + (f"; {other} run(s) not compared" if other else ""))


HOW = ("Each run records the real training steps with `torch.cuda.memory._record_memory_history` from an empty "
       "allocator (previous tensors dropped, cuBLAS workspaces cleared, cache emptied) and dumps the snapshot; "
       "peakledger predicts the same scenario on the GPU's device profile (compute capability 9.0: H100-80GB, 8.0: "
       "A100-80GB) with the caching-allocator model under the simulated log. Compared: the allocated peak (live "
       "requested bytes) and the reserved peak, and event by event the reserved bytes right after each allocation, "
       "pairing the k-th allocation of each size in the snapshot with the k-th of that size in the simulation "
       "(pairing by position would shift every later pair after one allocation only one side makes: a CUDA "
       "kernel's workspace, a cast the CPU-traced program lacks); the segments (cudaMalloc sizes) are also "
       "compared as sorted lists, which no difference in order affects. Targets: allocated within 1%, reserved "
       "within 2%.")


def matrix_text(models: list[str]) -> str:
    """The runs in words: how many of each model, and what the matrix varies."""
    counts = Counter(models)
    return (f"{len(models)} runs: " + ", ".join(f"{m} ({k})" for m, k in counts.items())
            + "; fp32, bf16 autocast, pure bf16; "
            "AdamW foreach and for-loop; checkpointing none and full; passes train (2 steps) and forward")


def no_gpu_section() -> str:
    return "\n".join([
        SECTION, "",
        "Not run on a GPU yet: no CUDA GPU was available on the machine where `python bench/validate_gpu.py --write` "
        "last ran, so nothing has been recorded or compared here. On a machine with one, run `python "
        "bench/validate_gpu.py --write` (sized for under 8 minutes on one H100, an estimate not yet measured; "
        "`--limit-seconds`, default 480, starts no run after that): it records a CUDA memory snapshot of each "
        "reference run into traces/data/gpu (with manifest.json) and compares peakledger's predictions with them "
        f"({matrix_text([c.model for c in all_configs()])}; `python bench/validate_gpu.py --dry-run` lists them "
        "with their predicted sizes). "
        "Recorded snapshots can be compared again anywhere with `python bench/validate_gpu.py --from-snapshots "
        "traces/data/gpu --write`.", "",
        HOW, ""])


def results_section(device: dict, rows: list[dict], seconds: float | None, source: str) -> str:
    cc = ".".join(map(str, device["compute_capability"]))
    profile = device["profile"] or "none (not profiled: measured only)"
    took = f", {seconds:.0f} s" if seconds is not None else ""
    return "\n".join([
        SECTION, "",
        f"{RESULTS_MARK}{device['name']} (compute capability {cc}, device profile {profile}), torch {device['torch']} "
        f"(CUDA {device['cuda']}; allocator rules of torch {device['allocator_rules']} in the model){took}; {source}. "
        f"{matrix_text([r['config']['model'] for r in rows])}. Regenerate with `python bench/validate_gpu.py "
        "--write` on a GPU, or from the "
        "committed snapshots with `python bench/validate_gpu.py --from-snapshots traces/data/gpu --write`.", "",
        HOW, "", f"**{summary(rows)}.**", "", *table(rows), "", *replay_lines(rows), *unclean(rows)])


def replay_lines(rows: list[dict]) -> list[str]:
    """The allocator check in words: how the recorded sequences replay through the allocator model, and for each run
    whose predicted reserved peak is not the measured one, its error split in two: the recorded sequence replayed at the
    model's own segment addresses against the measured peak (where cudaMalloc placed the segments), and the
    prediction against that replay (what the predicted program does differently)."""
    done = [r for r in rows if r.get("allocator_replay") and "predicted" in r]
    if not done:
        return []
    at = sum(r["allocator_replay"]["blocks_where_recorded"] for r in done)
    same = sum(r["allocator_replay"]["reserved_at_recorded_addresses"] == r["measured"]["reserved"] for r in done)
    off = []
    for r in done:
        m, p, rp = r["measured"]["reserved"], r["predicted"]["reserved"], r["allocator_replay"]["reserved"]
        if p != m:  # (recorded sequence at the model's addresses - measured) + (prediction - that) = the error
            off.append(f"{r['label']}: {_pct(p / m - 1)} = {_pct(rp / m - 1)} from where segments are placed "
                       f"(the recorded sequence at the model's addresses) {'+' if p >= rp else '-'} "
                       f"{abs(p - rp) / m:.2%} from the predicted program")
    return [f"Allocator check (each snapshot's own allocs and frees replayed through the allocator model, "
            f"bench/gpu_snapshots.py `allocator_replay`): at the addresses cudaMalloc returned in the recording, every "
            f"block gets the address torch gave it in {at}/{len(done)} runs "
            f"and the reserved peak is the measured one in "
            f"{same}/{len(done)}." + (f" Reserved peaks predicted otherwise: {'; '.join(off)}." if off else ""), ""]


def unclean(rows: list[dict]) -> list[str]:
    """A line naming the runs that did not start from an empty allocator (bytes still reserved after cleaning)."""
    dirty = [f"{r['label']} ({r['start_reserved']:,} B)" for r in rows if r.get("start_reserved")]
    return [f"Runs that started with bytes still reserved (in the snapshot's state at record start): "
            f"{'; '.join(dirty)}.", ""] if dirty else []


def shown(folder: Path) -> str:
    """A folder as the section names it: relative to the repository when inside it."""
    full = folder.resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(folder)


def write_section(text: str, path: Path) -> None:
    replace_section(SECTION, text, str(path))


def existing_results(path: Path) -> bool:
    if not path.exists():
        return False
    text = path.read_text()
    start = text.find(SECTION)
    if start < 0:
        return False
    end = text.find("\n## ", start + len(SECTION))
    return RESULTS_MARK in text[start:end if end >= 0 else len(text)]


# -- main ----------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT, help="where snapshots are saved "
                    "(default traces/data/gpu, committed as reference data)")
    ap.add_argument("--write", action="store_true", help=f"write '{SECTION[3:]}' into bench/VALIDATION.md")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--limit-seconds", type=float, default=LIMIT_SECONDS,
                    help="start no run after this many seconds (default 480); the rest are listed as skipped")
    ap.add_argument("--dry-run", action="store_true", help="list the runs and their predicted sizes; record nothing")
    ap.add_argument("--from-snapshots", type=Path, metavar="DIR",
                    help="compare the runs recorded in DIR (its manifest.json) again; no GPU needed")
    ap.add_argument("--only", action="append", metavar="TEXT", help="only the runs whose label holds TEXT (repeatable)")
    ap.add_argument("--stacks", choices=("python", "all", "none"), default="python",
                    help="stacks recorded with each allocation (default python: small files; all: C++ frames too)")
    ap.add_argument("--validation-md", type=Path, default=Path(VALIDATION), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    configs = select(all_configs(), args.only)
    say = (lambda *_: None) if args.json else print
    if args.dry_run:
        device = cuda_device()
        rows = dry_run(configs, device, say)
        if args.json:
            print(json.dumps({"dry_run": True, "device": device, "runs": rows}, indent=1))
        else:
            entries = sum(r.get("trace_entries", 0) for r in rows)
            failed = sum("failed" in r for r in rows)
            print(f"{len(rows)} runs ({failed} cannot be built), predicted on the "
                  f"{rows[0].get('profile', '?') if rows else '?'} profile; ~{entries:,} trace entries in all; "
                  f"snapshots would go to {shown(args.output_dir)}")
        return 0
    if args.from_snapshots is not None:
        try:
            device, rows = from_snapshots(args.from_snapshots, args.only, say)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"validate_gpu.py: {args.from_snapshots / MANIFEST}: not a manifest this script wrote ({e})",
                  file=sys.stderr)
            return 2
        source = f"compared from the snapshots in {shown(args.from_snapshots)}"
        seconds = None
    else:
        device = cuda_device()
        if device is None:
            kept = args.write and existing_results(args.validation_md)
            if args.write and not kept:
                write_section(no_gpu_section(), args.validation_md)
            wrote = (f"; kept the results already in {args.validation_md}" if kept else
                     f"; wrote '{SECTION[3:]}' (not run on a GPU yet) into {args.validation_md}" if args.write else "")
            if args.json:
                print(json.dumps({"gpu": None, "message": NO_GPU, "runs": len(configs),
                                  "written": args.write and not kept}))
            else:
                print(NO_GPU + wrote)
            return 0
        if device["profile"] is None:
            say(f"{device['name']} (compute capability {device['compute_capability']}) is not profiled in peakledger: "
                "snapshots are recorded, nothing is predicted")
        t0 = time.perf_counter()
        rows = run_matrix(configs, device, args.output_dir, args.limit_seconds, say, args.stacks)
        seconds = time.perf_counter() - t0
        source = f"snapshots in {shown(args.output_dir)}"
    if args.json:
        print(json.dumps({"device": device, "summary": summary(rows), "runs": rows}, indent=1, default=str))
    else:
        print(summary(rows))
    if args.write:
        write_section(results_section(device, rows, seconds, source), args.validation_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
