"""Checkpoint save and load on the CPU: real torch runs under the exact allocation tracker, held against the
simulation of the same run on the "cpu" device profile (models/checkpoint_io/).

    python bench/validate_checkpoint_io.py

Each save case trains the reference model (traces/reference/nanogpt.py) for 2 steps and saves after each
(`checkpoint_every=1`, so the optimizer states exist), tracked from start to end; the simulation is the
same setup with that `save_mode`. Each load case saves a trained model first (untracked), then tracks
building the model, loading the checkpoint and 2 training steps; the simulation has that `load_mode`.
The full-state modes run on real FSDP2 ranks (spawned CPU processes, torch's fake process group for a
deterministic order of frees, and gloo over 127.0.0.1 for the real transport): one step, then
`get_model_state_dict` / `get_optimizer_state_dict(full_state_dict=True, cpu_offload=...)`, every rank
tracked and every rank simulated.
The *spike* of a phase is the highest live total inside it minus the live total just before it (the
same definition on both sides). Mechanisms the tracker cannot see (Python objects: pickle bytes, an
`io.BytesIO` archive) are measured with tracemalloc, and every spike is cross-checked with
torch.profiler's allocator events (they include storages created outside dispatch). Writes the
"Checkpoint save and load (CPU)" section of bench/VALIDATION.md (the rest of the file is kept).

What the CPU cannot show: there is no device, so no device->host copy exists (`storage.cpu()` and
`tensor.to("cpu")` return the CPU tensor itself) and nothing is pinned: the host staging of torch-save,
sharded and the full modes on a GPU is modelled from torch's source (see models/checkpoint_io/save_load.py), not
measured. It does show what those copies' lifetimes follow: the DCP writer keeps every staged tensor
until the file is written (measured through the clones its CPU loader makes of views), the async
stager's copy is made once and reused, torch.load holds the whole checkpoint, load_state_dict copies
in place and the optimizer adopts the loaded states, assign=True does not duplicate parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import tempfile
import time
import tracemalloc
import warnings

import torch
from sections import replace_section  # bench/sections.py, beside this script

from peakledger.analysis.validate import compare_logs
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, EventLog, Phase, Pool
from peakledger.simulator.run_metadata import RunMetadata
from peakledger.traces.reference import build_model, make_batch, make_optimizer
from peakledger.traces.tracker import AllocationTracker, training_loop

SECTION = "## Checkpoint save and load (CPU)"
STEPS = 2


@dataclasses.dataclass(frozen=True)
class Config:
    """One reference model and training setup (fp32: what the tracker and the reference models run)."""

    model: str
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    micro_batch: int = 2
    seq_len: int = 32

    @property
    def label(self) -> str:
        return f"{self.model}, {self.optimizer} {self.optimizer_impl}"

    def model_config(self):
        cfg = preset(self.model)
        # sdpa: nanoGPT's eager mask is a non-persistent buffer a meta-device model could not rebuild
        return dataclasses.replace(cfg, attention="sdpa") if hasattr(cfg, "attention") else cfg

    def setup(self, **changes) -> TrainingSetup:
        return TrainingSetup(**{"micro_batch": self.micro_batch, "seq_len": self.seq_len, "steps": STEPS,
                                "optimizer": self.optimizer, "optimizer_impl": self.optimizer_impl, **changes})


CONFIGS = [Config("tiny"), Config("tiny-llama", "adam", "for-loop"), Config("tiny-mlp", "sgd-momentum")]


# -- measuring ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Window:
    """What one call allocated while tracked: the spike over the live total at its start, what it left
    allocated, and the Python heap's peak (tracemalloc: objects the tracker does not see)."""

    spike: int
    retained: int
    python_peak: int


@contextlib.contextmanager
def window(tracker: AllocationTracker, out: list):
    first = len(tracker.raw)
    tracemalloc.start()
    try:
        yield
    finally:
        python_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        running = spike = 0
        for _t, action, rid, *_ in tracker.raw[first:]:
            running += tracker.records[rid].nbytes * (1 if action is Action.ALLOC else -1)
            spike = max(spike, running)
        out.append(Window(spike, running, python_peak))


def profiler_spike(fn) -> tuple[int, int]:
    """(spike, retained) of `fn` from torch.profiler's allocator events: every CPU allocation and free,
    storages made outside dispatch included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = spike = 0
    for e in sorted((e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start):
        running += e.cpu_memory_usage
        spike = max(spike, running)
    return spike, running


def state_dict(model, optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def savers(directory: str) -> dict:
    """The real save of each mode, given (model, optimizer, step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))  # kept across saves, as torchtitan does

    def torch_save(model, optimizer, step):
        torch.save(state_dict(model, optimizer), os.path.join(directory, f"step{step}.pt"))

    def sharded(model, optimizer, step):
        dcp.save(state_dict(model, optimizer), checkpoint_id=os.path.join(directory, f"dcp{step}"), no_dist=True)

    def async_save(model, optimizer, step):
        dcp.async_save(state_dict(model, optimizer), checkpoint_id=os.path.join(directory, f"async{step}"),
                       async_stager=stager, no_dist=True).result()

    return {"torch-save": torch_save, "sharded": sharded, "async": async_save}


def measure_save(config: Config, mode: str) -> tuple[EventLog, list[Window]]:
    """Train STEPS steps, saving with `mode` after each, all under one tracker."""
    cfg, setup = config.model_config(), config.setup()
    torch.set_num_threads(1)
    model = build_model(cfg, setup)
    optimizer = make_optimizer(model, setup)
    batches = make_batch(cfg, setup)
    windows: list[Window] = []
    with tempfile.TemporaryDirectory() as d:
        save = savers(d)[mode]
        tracker = AllocationTracker(model, optimizer, known=tuple(t for b in batches for t in b))
        with tracker:
            for step in range(1, STEPS + 1):
                training_loop(tracker, model, optimizer, batches, steps=1, first_step=step)
                with tracker.phase(Phase.CHECKPOINT, step), window(tracker, windows):
                    save(model, optimizer, step)
    return tracker.log(RunMetadata(mode=mode)), windows


def trained(config: Config):
    """A model and optimizer after one real step (the optimizer states exist), untracked."""
    cfg, setup = config.model_config(), config.setup()
    torch.set_num_threads(1)
    model = build_model(cfg, setup)
    optimizer = make_optimizer(model, setup)
    x, y = make_batch(cfg, setup)[0]
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def retie(model) -> None:
    """assign=True gives tied weights two Parameters (one storage): tie them again, as HF's tie_weights does."""
    if getattr(getattr(model, "cfg", None), "tied", False):
        if hasattr(model, "transformer"):
            model.transformer.wte.weight = model.lm_head.weight
        else:
            model.lm_head.weight = model.model.embed_tokens.weight


def rebuild_buffers(model, buffers: dict) -> None:
    """Non-persistent buffers are not in a state dict: a meta-device model gets them anew (Llama's rotary
    `inv_freq`), here cloned from `buffers` of a model built on the CPU."""
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, buffers[name].clone(), persistent=False)


def load(mode: str, config: Config, path: str, model, buffers: dict | None = None):
    """The real load of `mode` into `model` (built on the CPU) or, for meta-assign, into a meta-device
    model (its non-persistent buffers rebuilt from `buffers`); returns (model, optimizer)."""
    setup = config.setup()
    sd = torch.load(path, map_location="cpu")
    if mode == "meta-assign":
        model.load_state_dict(sd["model"], assign=True)
        retie(model)
        rebuild_buffers(model, buffers or {})
    else:
        model.load_state_dict(sd["model"])
    optimizer = make_optimizer(model, setup)
    optimizer.load_state_dict(sd["optimizer"])
    return model, optimizer


def measure_load(config: Config, mode: str) -> tuple[EventLog, Window]:
    """Save a trained model, then track: build (or meta-build), load with `mode`, train STEPS steps."""
    cfg, setup = config.model_config(), config.setup()
    windows: list[Window] = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "checkpoint.pt")
        model, optimizer = trained(config)
        torch.save(state_dict(model, optimizer), path)
        del model, optimizer
        batches = make_batch(cfg, setup)
        known = tuple(t for b in batches for t in b)
        buffers = None
        if mode == "meta-assign":
            with torch.device("meta"):  # built before tracking: the tracker would count meta storages
                target = build_model(cfg, setup)
            buffers = dict(build_model(cfg, setup).named_buffers())  # the values to rebuild buffers from
            tracker = AllocationTracker(known=known + tuple(buffers.values()))
        else:
            target = build_model(cfg, setup)
            tracker = AllocationTracker(target, known=known)
        with tracker:
            with tracker.phase(Phase.LOAD), window(tracker, windows):
                model, optimizer = load(mode, config, path, target, buffers)
            tracker.optimizer = optimizer
            for step in range(1, STEPS + 1):
                training_loop(tracker, model, optimizer, batches, steps=1, first_step=step)
    return tracker.log(RunMetadata(mode=mode)), windows[0]


def simulated(config: Config, **checkpoint) -> EventLog:
    return simulate(describe(config.model_config(), config.setup(**checkpoint), "cpu"))


def phase_spike(log: EventLog, phase: Phase, step: int, pool: Pool = Pool.DEVICE, rank: int = 0) -> int:
    """The highest live total of (`rank`, `pool`) inside (phase, step) minus the live total just before it
    (0 if the phase allocates nothing there)."""
    running, before, best = 0, None, None
    for e in log.events:
        if e.block.pool is not pool or e.block.rank != rank:
            continue
        if e.phase is phase and e.step == step and before is None:
            before = best = running
        running += e.delta
        if e.phase is phase and e.step == step:
            best = max(best, running)
    return 0 if before is None else best - before


def state_bytes(model, optimizer) -> int:
    """Bytes of the distinct storages of the model's and optimizer's state (tied weights once)."""
    storages = {}
    for t in list(model.state_dict().values()) + [v for s in optimizer.state.values() for v in s.values()
                                                  if isinstance(v, torch.Tensor)]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


# -- cases --------------------------------------------------------------------------------------------

def save_case(config: Config, mode: str) -> dict:
    measured, windows = measure_save(config, mode)
    predicted = simulated(config, checkpoint_every=1, save_mode=mode)
    v = compare_logs(measured, predicted)
    return {"config": config, "mechanism": mode, "worst_phase": v.worst_phase, "steps": [
        {"step": s, "measured": phase_spike(measured, Phase.CHECKPOINT, s),
         "predicted": phase_spike(predicted, Phase.CHECKPOINT, s), "python_peak": windows[s - 1].python_peak}
        for s in range(1, STEPS + 1)], "overall": v.overall}


def load_case(config: Config, mode: str) -> dict:
    measured, w = measure_load(config, mode)
    predicted = simulated(config, load_mode=mode)
    v = compare_logs(measured, predicted)
    load_peak = next(p for p in v.phases if p.label == "load step 0")
    return {"config": config, "mechanism": mode, "worst_phase": v.worst_phase, "load_peak": load_peak,
            "overall": v.overall,
            "phases": [p for p in v.phases if p.label != "load step 0"], "spike": w.spike}


def state_dict_case(config: Config) -> dict:
    """model.state_dict() and optimizer.state_dict(): views of the live tensors."""
    model, optimizer = trained(config)
    windows: list[Window] = []
    tracker = AllocationTracker(model, optimizer)
    with tracker:
        with window(tracker, windows):
            sd = model.state_dict()
        with window(tracker, windows):
            osd = optimizer.state_dict()
    del sd, osd
    return {"config": config, "model": windows[0], "optimizer": windows[1]}


def bytesio_case(config: Config) -> dict:
    """torch.save to an io.BytesIO: no tensor memory, but the archive itself in Python memory."""
    model, optimizer = trained(config)
    windows: list[Window] = []
    tracker = AllocationTracker(model, optimizer)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.pt")
        with tracker:
            with window(tracker, windows):
                torch.save(state_dict(model, optimizer), path)
            with window(tracker, windows):
                buffer = io.BytesIO()
                torch.save(state_dict(model, optimizer), buffer)
        file_size = os.path.getsize(path)
    return {"config": config, "file": windows[0], "bytesio": windows[1], "file_size": file_size,
            "archive": len(buffer.getbuffer()), "state": state_bytes(model, optimizer)}


def dcp_views_case(config: Config) -> dict:
    """DCP save of a state dict whose device-resident tensors (all but Adam's host `step`) are views of
    twice-larger storages: the CPU loader clones each one, as a GPU loader copies each to the host, and
    the writer keeps every clone until the file is written. Measured spike vs the host spike the
    simulator predicts for the same save from a GPU (H100 profile, save_mode "sharded"), and vs the
    largest tensor (what it would be if the copies did not accumulate)."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = trained(config)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in optimizer.state_dict()["state"].items():
        flat.update({f"optimizer.{pid}.{k}": v for k, v in st.items()})
    views = {}
    for k, v in flat.items():
        if k.endswith(".step"):  # on the host with a GPU (non-fused optimizers): not staged
            views[k] = v
            continue
        big = torch.empty(2 * v.numel(), dtype=v.dtype)
        views[k] = big[:v.numel()].view(v.shape).copy_(v)
    windows: list[Window] = []
    with tempfile.TemporaryDirectory() as d:
        tracker = AllocationTracker(known=tuple(views.values()))  # the views' own storages are not new
        with tracker, window(tracker, windows):
            dcp.save(views, checkpoint_id=os.path.join(d, "views"), no_dist=True)
    gpu = simulate(describe(config.model_config(), config.setup(checkpoint_every=1, save_mode="sharded"),
                            "H100-80GB"))
    return {"config": config, "measured": windows[0].spike, "retained": windows[0].retained,
            "predicted": phase_spike(gpu, Phase.CHECKPOINT, 1, Pool.HOST),
            "one_at_a_time": max(v.numel() * v.element_size() for k, v in views.items() if not k.endswith(".step"))}


def profiler_rows(config: Config) -> list[tuple[str, tuple[int, int]]]:
    """The same calls under torch.profiler: allocator spikes, storages made outside dispatch included."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, optimizer = trained(config)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.pt")
        rows.append(("torch.save(file)", profiler_spike(lambda: torch.save(state_dict(model, optimizer), path))))
        rows.append(("dcp.save", profiler_spike(
            lambda: dcp.save(state_dict(model, optimizer), checkpoint_id=os.path.join(d, "dcp"), no_dist=True))))
        stager = DefaultStager(StagingOptions(False, False, False, False))
        for k in (1, 2):
            rows.append((f"dcp.async_save #{k} (stager reused)", profiler_spike(
                lambda: dcp.async_save(state_dict(model, optimizer), checkpoint_id=os.path.join(d, f"a{k}"),
                                       async_stager=stager, no_dist=True).result())))
        target = build_model(config.model_config(), config.setup())
        rows.append(("torch.load + load_state_dict (full-then-device)",
                     profiler_spike(lambda: load("full-then-device", config, path, target))))
        with torch.device("meta"):
            meta = build_model(config.model_config(), config.setup())
        buffers = dict(target.named_buffers())
        rows.append(("torch.load + assign=True (meta-assign)",
                     profiler_spike(lambda: load("meta-assign", config, path, meta, buffers))))
    return rows, state_bytes(model, optimizer)


# -- full state dicts on real FSDP2 ranks (gloo, CPU) -------------------------------------------------

FULL_OPTIONS = {"full-rank0-offload": True, "full-all": False}  # save_mode -> StateDictOptions(cpu_offload=...)


def process_group(rank: int, world_size: int, port: int, backend: str):
    """Join `backend`'s process group (traces/harness.py: gloo over 127.0.0.1 only, or torch's fake group: no
    peers, no data moved, the same allocations in a deterministic order), for at most 120 s a collective."""
    from peakledger.traces import harness

    return harness.process_group(rank, world_size, port, 120, backend)


def full_state_rank(rank: int, world_size: int, port: int, out_dir: str, mode: str, config: Config,
                    backend: str) -> None:
    """One spawned rank: FSDP2 (fully_shard per block, then the root, as traces/distributed.py wraps it),
    one tracked training step, then `get_model_state_dict` + `get_optimizer_state_dict` with
    full_state_dict=True and the mode's cpu_offload, torch.save by rank 0, everything dropped, in
    Phase.CHECKPOINT. The log goes to `out_dir` (traces/store.py JSON)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from peakledger.traces import distributed
    from peakledger.traces.store import save_log
    from peakledger.traces.tracker import training_loop

    warnings.filterwarnings("ignore")
    cfg, setup = config.model_config(), config.setup(world_size=world_size, dp_engine="fsdp2")
    with process_group(rank, world_size, port, backend):
        torch.set_num_threads(1)
        model = build_model(cfg, setup, seed=0)
        batches = make_batch(cfg, setup, seed=1 + rank)
        job = distributed.RankJob(cfg, setup, world_size, "fsdp2", True, None, port, out_dir)
        prepared = distributed.FSDP2.before_tracking(model, job)
        tracker = AllocationTracker(prepared.tracked_model, prepared.tracked_optimizer, rank=rank,
                                    known=tuple(t for b in batches for t in b))
        torch.manual_seed(0)
        with tracker:
            training_loop(tracker, prepared.model, prepared.optimizer, batches, 1, 1, True)
            with tracker.phase(Phase.CHECKPOINT, 1):
                options = StateDictOptions(full_state_dict=True, cpu_offload=FULL_OPTIONS[mode])
                full = {"model": get_model_state_dict(prepared.model, options=options),
                        "optimizer": get_optimizer_state_dict(prepared.model, prepared.optimizer, options=options)}
                if rank == 0:
                    torch.save(full, os.path.join(out_dir, "full.pt"))
                del full
                dist.barrier()
        save_log(tracker.log(RunMetadata(mode=mode, backend=backend)), os.path.join(out_dir, f"rank{rank}.json"))


def measure_full_state(config: Config, mode: str, world_size: int, backend: str = "fake",
                       timeout_s: float = 120.0) -> list[EventLog]:
    """`full_state_rank` on `world_size` spawned CPU processes (gloo or the fake group); one EventLog per rank."""
    import torch.multiprocessing as mp

    from peakledger.traces.distributed import free_loopback_port
    from peakledger.traces.store import load_log

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # spawned ranks import this module by name
        sys.path.insert(0, here)
    with tempfile.TemporaryDirectory(prefix="peakledger-ckpt-") as out:
        context = mp.start_processes(full_state_rank, nprocs=world_size, join=False, start_method="spawn",
                                     args=(world_size, free_loopback_port(), out, mode, config, backend))
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{mode} on {world_size} ranks did not finish in {timeout_s:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [load_log(os.path.join(out, f"rank{r}.json")) for r in range(world_size)]


def full_state_case(config: Config, mode: str, world_size: int, backend: str = "fake") -> dict:
    """Per rank: the checkpoint spike measured vs simulated (every rank described, "cpu" profile)."""
    measured = measure_full_state(config, mode, world_size, backend)
    setup = config.setup(world_size=world_size, dp_engine="fsdp2", steps=1, checkpoint_every=1, save_mode=mode)
    predicted = simulate(describe(config.model_config(), setup, "cpu", ranks=list(range(world_size))))
    ranks = []
    for r, log in enumerate(measured):
        v = compare_logs(log, predicted, rank=r)
        ranks.append({"rank": r, "measured": phase_spike(log, Phase.CHECKPOINT, 1, rank=r),
                      "predicted": phase_spike(predicted, Phase.CHECKPOINT, 1, rank=r), "overall": v.overall})
    return {"config": config, "mechanism": mode, "world_size": world_size, "backend": backend, "ranks": ranks}


# -- report -------------------------------------------------------------------------------------------

def _err(measured: int, predicted: int) -> str:
    if measured == predicted:
        return "exact"
    return f"{predicted - measured:+,} B" + (f" ({(predicted - measured) / measured:+.3%})" if measured else "")


def render(saves, loads, dicts, bytesio, views, full, profiler, seconds: float) -> str:
    spikes = [(s["measured"], s["predicted"]) for r in saves for s in r["steps"]]
    spikes += [(r["load_peak"].measured, r["load_peak"].predicted) for r in loads]
    exact = sum(m == p for m, p in spikes)
    views_exact = sum(r["measured"] == r["predicted"] for r in views)
    fake_ranks = [x for r in full if r["backend"] == "fake" for x in r["ranks"]]
    gloo_ranks = [x for r in full if r["backend"] == "gloo" for x in r["ranks"]]
    fake_exact = sum(x["measured"] == x["predicted"] for x in fake_ranks)
    gloo_exact = sum(x["measured"] == x["predicted"] for x in gloo_ranks)
    worst_overall = max([*saves, *loads], key=lambda r: abs(r["overall"].error))
    worst_where = worst_overall["worst_phase"]
    lines = [
        SECTION, "",
        "Real CPU runs of the reference models (fp32, micro-batch 2, seq 32 for the transformers, nanoGPT "
        "tiny with sdpa) under the exact allocation tracker, against the simulation of the same run on "
        "the \"cpu\" profile with that `save_mode` / `load_mode` (models/checkpoint_io/). Saves: 2 steps, "
        "a save after each; loads: a checkpoint of a trained model loaded, then 2 steps. Spike = the "
        "highest live total inside the phase minus the live total just before it. "
        f"{len(spikes)} phase spikes, {len(saves) + len(loads)} single-process runs and {len(full)} distributed "
        f"ones in {seconds:.1f} s; regenerate with "
        "`python bench/validate_checkpoint_io.py`.", "",
        f"**Summary: {exact}/{len(spikes)} checkpoint save / load spikes exact to the byte; the DCP writer's "
        f"retention of staged copies exact in {views_exact}/{len(views)}; full state dicts on real FSDP2 "
        f"ranks exact in {fake_exact}/{len(fake_ranks)} rank spikes with the fake process group and "
        f"{gloo_exact}/{len(gloo_ranks)} on gloo (its worker-thread race); whole-run peaks within "
        f"{abs(worst_overall['overall'].error):.3%} (worst: {worst_overall['config'].label}, "
        f"{worst_overall['mechanism']}: the gap is in {worst_where}, the training steps' own, the same "
        "without checkpoints).**", "",
        "What the CPU shows and what it cannot: on a CPU-only machine there is no device, so no "
        "device->host copy exists (`storage.cpu()` / `.to(\"cpu\")` return the tensor itself) and nothing "
        "is pinned. The host staging that torch-save, sharded and the full-* modes make on a GPU (one "
        "host copy at a time in torch.save; every staged copy kept until the file is written in DCP; "
        "the gathered full tensors of a full state dict) is modelled from torch 2.13's source, not "
        "measured here; on the \"cpu\" profile the model predicts no copy, and the CPU confirms it. What "
        "the CPU does measure: state_dict() allocates nothing; torch.load holds the whole checkpoint; "
        "load_state_dict copies in place; the optimizer adopts the loaded states (the first step then "
        "creates none); assign=True does not duplicate; the async stager copies every storage once and "
        "reuses the copy; the DCP writer keeps every staged tensor until its file is written.", "",
        "### Saves (spike of the checkpoint phase, per step)", "",
        "| config | save_mode | step | measured spike B | predicted spike B | error | Python heap peak B "
        "(tracemalloc) | whole-run peak measured / predicted |", "|---|---|---:|---:|---:|---|---:|---|"]
    for r in saves:
        for s in r["steps"]:
            o = r["overall"]
            lines.append(f"| {r['config'].label} | {r['mechanism']} | {s['step']} | {s['measured']:,} | "
                         f"{s['predicted']:,} | {_err(s['measured'], s['predicted'])} | {s['python_peak']:,} | "
                         f"{o.measured:,} / {o.predicted:,} ({o.error:+.3%}) |")
    lines += ["", "### Loads (peak of the load phase, then the training steps)", "",
              "| config | load_mode | load peak measured B | predicted B | error | load spike over the built "
              "model B | whole-run peak measured / predicted | worst later phase |",
              "|---|---|---:|---:|---|---:|---|---|"]
    for r in loads:
        lp, o = r["load_peak"], r["overall"]
        worst = max(r["phases"], key=lambda p: abs(p.error))
        lines.append(f"| {r['config'].label} | {r['mechanism']} | {lp.measured:,} | {lp.predicted:,} | "
                     f"{_err(lp.measured, lp.predicted)} | {r['spike']:,} | {o.measured:,} / {o.predicted:,} "
                     f"({o.error:+.3%}) | {worst.label} {worst.error:+.3%} |")
    lines += ["", "### Full state dicts on real FSDP2 ranks (CPU: the fake process group and gloo)", "",
              "fully_shard per block, then the root; one training step; then `get_model_state_dict` + "
              "`get_optimizer_state_dict(full_state_dict=True, cpu_offload=...)`, torch.save by rank 0. "
              "full-rank0-offload = cpu_offload=True (rank 0 only keeps the state; on the CPU `.to(\"cpu\")` "
              "keeps the gathered tensor itself), full-all = cpu_offload=False (every rank keeps it). The "
              "simulation describes every rank.", "",
              "| config | save_mode | backend | ranks | rank | measured spike B | predicted spike B | error | "
              "whole-run peak measured / predicted |", "|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in full:
        for x in r["ranks"]:
            o = x["overall"]
            lines.append(f"| {r['config'].label} | {r['mechanism']} | {r['backend']} | {r['world_size']} | "
                         f"{x['rank']} | {x['measured']:,} | {x['predicted']:,} | "
                         f"{_err(x['measured'], x['predicted'])} | "
                         f"{o.measured:,} / {o.predicted:,} ({o.error:+.3%}) |")
    lines += ["", "### Single calls", "",
              "| config | call | tracker spike B | retained B | Python heap peak B | model |",
              "|---|---|---:|---:|---:|---|"]
    for r in dicts:
        for what in ("model", "optimizer"):
            w = r[what]
            lines.append(f"| {r['config'].label} | {what}.state_dict() | {w.spike:,} | {w.retained:,} | "
                         f"{w.python_peak:,} | 0 (views) |")
    for r in bytesio:
        lines.append(f"| {r['config'].label} | torch.save(file) | {r['file'].spike:,} | {r['file'].retained:,} | "
                     f"{r['file'].python_peak:,} | 0 on the cpu profile (pickle bytes not modelled) |")
        lines.append(f"| {r['config'].label} | torch.save(io.BytesIO) | {r['bytesio'].spike:,} | "
                     f"{r['bytesio'].retained:,} | {r['bytesio'].python_peak:,} | not modelled: the archive "
                     f"({r['archive']:,} B for {r['state']:,} B of state; the file is {r['file_size']:,} B) "
                     "lives in Python memory |")
    for r in views:
        lines.append(f"| {r['config'].label} | dcp.save of views (CPU loader clones each) | {r['measured']:,} | "
                     f"{r['retained']:,} | - | sharded host spike from a GPU (H100 profile) {r['predicted']:,} "
                     f"({_err(r['measured'], r['predicted'])}); one at a time would be {r['one_at_a_time']:,} |")
    cfg, (rows, state) = profiler
    lines += ["", f"### torch.profiler cross-check ({cfg.label}, {state:,} B of parameters and optimizer "
              "states)", "",
              "Allocator spike of each call and what it leaves allocated (its return value dropped: the "
              "meta-assign model keeps its loaded parameters, the optimizer and its states go), every CPU "
              "allocation counted, storages made outside dispatch included.", "",
              "| call | profiler spike B | retained B |", "|---|---:|---:|"]
    lines += [f"| {name} | {spike:,} | {kept:,} |" for name, (spike, kept) in rows]
    lines += ["", "Notes:", "",
              "- torch.save pickles first, then writes storage by storage; on a GPU each storage is copied "
              "to the host by `storage.cpu()` into the loop variable, dropped before the next copy: the "
              "model's torch-save host spike is the largest device storage (one at a time), never the sum.",
              "- DCP's FileSystemWriter (torch 2.13) keeps each staged tensor in `tensor_dict` (used only "
              "for safetensors) until the file is closed: with one file per rank the staging adds up to the "
              "rank's whole written state (the dcp.save-of-views row measures it), which the sharded mode "
              "models; the overlapping loader's 10 MB copy-ahead bounds nothing.",
              "- The async stager (`DefaultStager` reused across saves) caches one CPU storage per source "
              "storage: the second save allocates nothing new. The tracker sees those storages when the "
              "copy reads them (they are created outside dispatch); the profiler agrees.",
              "- The Python heap peaks (tracemalloc) are per-call bookkeeping (pickled metadata; the first "
              "dcp.save also imports and caches), not proportional to the state: tiny-mlp's 6.3 MB of state "
              "gives a smaller heap peak than tiny's 1.4 MB. Only an `io.BytesIO` target holds the archive.",
              "- Full state dicts: every state-dict key is gathered (the tied embedding twice); a rank whose "
              "shard is shorter than the padded one pads it first (`constant_pad_nd`, one padded shard, "
              "transient). On the ranks that drop each gathered tensor (rank0_only), the functional "
              "collective sometimes frees the previous output only when the next one is waited on, so two "
              "consecutive outputs can coexist for a moment on gloo (its worker threads drop their "
              "reference a moment after `wait()` returns, traces/distributed.py: a few hundred bytes to one "
              "tensor above the model in some runs, exact in others); with the fake process group the order "
              "is deterministic and the model frees each at once, as measured.",
              "- meta-assign: the meta model is built before tracking (the tracker counts meta storages as "
              "allocations, a tracker limitation); tied weights are re-tied after `assign=True`.", ""]
    return "\n".join(lines)


def main() -> int:
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    saves = [save_case(c, m) for c in CONFIGS for m in ("torch-save", "sharded", "async")]
    loads = [load_case(c, m) for c in CONFIGS for m in ("full-then-device", "map-to-device", "meta-assign")]
    for r in saves:
        print(r["config"].label, r["mechanism"], [(s["measured"], s["predicted"]) for s in r["steps"]], flush=True)
    for r in loads:
        print(r["config"].label, r["mechanism"], r["load_peak"].measured, r["load_peak"].predicted, flush=True)
    dicts = [state_dict_case(c) for c in CONFIGS]
    bytesio = [bytesio_case(c) for c in CONFIGS]
    views = [dcp_views_case(c) for c in CONFIGS]
    full = [full_state_case(CONFIGS[0], mode, n, backend) for backend in ("fake", "gloo") for n in (2, 3)
            for mode in FULL_OPTIONS]
    for r in full:
        print(r["backend"], r["mechanism"], r["world_size"], [(x["measured"], x["predicted"]) for x in r["ranks"]],
              flush=True)
    profiler = (CONFIGS[0], profiler_rows(CONFIGS[0]))
    section = render(saves, loads, dicts, bytesio, views, full, profiler, time.perf_counter() - t0)
    replace_section(SECTION, section)
    print(section.splitlines()[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
