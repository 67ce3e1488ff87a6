"""The scaffold every real multi-process CPU run stands on: the ranks spawned on this machine, joined in one process
group over the loopback interface, each running its program under its own tracker, their logs collected in rank order.

traces/distributed.py (FSDP2, DDP, ZeroRedundancyOptimizer), pipeline_run.py, tensor_run.py, context_run.py,
expert_run.py and mesh_run.py plug in the same way, each keeping only its parallelism (what a rank builds and how it
steps):

    @dataclass(frozen=True)
    class MyJob(Job):                    # what every rank is sent (picklable): model_cfg, setup, port, out_dir,
        extra: int = 0                   # seed, lr, timeout_s, and the run's own fields

    def _measure_rank(rank: int, job: MyJob) -> EventLog:      # module level: a spawned rank imports it by name
        ...                                                     # the rank's model, optimizer, tracker and batches
        with tracking(tracker, job.seed):                       # the same RNG on every rank, then the tracker
            train_steps(tracker, model, optimizer, batches, job.setup)          # or the run's own step loop
        return tracker.log(run_metadata(rank, world_size, job.model_cfg, job.setup).updated(engine=...))

    def measure_mine(model_cfg, setup, *, seed=0, timeout_s=120.0) -> list[EventLog]:
        check(model_cfg, setup)                                 # refuse what is not run before any process starts
        job = functools.partial(MyJob, model_cfg, setup, seed=seed, timeout_s=timeout_s)   # job(port, out_dir)
        return measure_ranks(_measure_rank, job, nprocs, "what a timeout names", prefix="peakledger-mine-")

`measure_ranks` does the rest, the same for every run:

- a temporary directory for the logs and a TCP port free on 127.0.0.1 (`free_loopback_port`), the job built with
  both (any picklable object with `port`, `out_dir` and `timeout_s` will do: traces/distributed.py's `RankJob`);
- `nprocs` processes started by torch.multiprocessing ("spawn"); each joins the process group (`process_group`: gloo
  over the loopback interface only, `gloo_group`, or torch's fake group), runs torch on one intra-op thread, runs
  `measure_rank(rank, job)` and saves its EventLog as traces/store.py JSON in the directory (`log_path`);
- errors and timeouts (`spawn_ranks`): a rank that raises makes torch.multiprocessing end the others and its
  traceback is raised here as RuntimeError; every rank is joined within `job.timeout_s` seconds, else every one
  still running is killed and TimeoutError is raised;
- the logs read back, in rank order.

Spawned processes re-import the caller's main module: call a run under `if __name__ == "__main__":` in a script
(pytest and imported modules need nothing).

gloo's worker threads keep a collective's tensors a moment after the caller's wait returned; `wait_released` (with
`holders` and a `ReleaseCount`) waits until the process group has let go of them, so that every free lands where the
program drops its reference (traces/distributed.py `BackendReleased` explains it for FSDP2).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..models.config import TrainingSetup
from ..models.fields import as_keys
from ..simulator.events import EventLog
from ..simulator.run_metadata import RunMetadata
from .store import load_log, save_log
from .tracker import training_loop

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Job:
    """What every process of a run is sent (picklable): the model and setup, where the ranks meet (`port`) and leave
    their logs (`out_dir`), both filled in by `measure_ranks`, the seed (the model's; the data's from seed + 1), the
    learning rate and the timeout."""

    model_cfg: Any
    setup: TrainingSetup
    port: int
    out_dir: str
    seed: int = 0
    lr: float = 1e-3
    timeout_s: float = 120.0


def measure_ranks(measure_rank: Callable[[int, Any], EventLog], make_job: Callable[[int, str], Any], nprocs: int,
                  what: str, *, prefix: str, backend: str = "gloo") -> list[EventLog]:
    """`measure_rank(rank, job)` on `nprocs` spawned CPU processes joined in one `backend` process group ("gloo" over
    127.0.0.1, or "fake"), `job = make_job(port, out_dir)` (a free loopback port, a temporary directory named
    `prefix`...); one EventLog per rank, in rank order. A failing rank's traceback is raised as RuntimeError; past
    `job.timeout_s` seconds every rank is killed and TimeoutError names `what`."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        job = make_job(free_loopback_port(), tmp)
        spawn_ranks(_rank_main, _Launch(measure_rank, job, nprocs, backend), nprocs, job.timeout_s, what)
        return [load_log(log_path(tmp, r)) for r in range(nprocs)]


@dataclass(frozen=True)
class _Launch:
    """What `measure_ranks` sends every rank: the run's per-rank function (pickled by name) and its job."""

    measure_rank: Callable[[int, Any], EventLog]
    job: Any
    world_size: int
    backend: str


def _rank_main(rank: int, launch: _Launch) -> None:
    """The body of one spawned process: join the group, run on one thread, save the log, always leave the group."""
    job = launch.job
    with process_group(rank, launch.world_size, job.port, job.timeout_s, launch.backend):
        torch.set_num_threads(1)
        save_log(launch.measure_rank(rank, job), log_path(job.out_dir, rank))


def log_path(out_dir: str, rank: int) -> Path:
    """Where rank `rank` leaves its log."""
    return Path(out_dir) / f"rank{rank}.json"


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; the socket is closed again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def spawn_ranks(main, job, nprocs: int, timeout_s: float, what: str) -> None:
    """Start `main(rank, job)` in one process per rank and wait for all of them, bounded by `timeout_s`. A rank
    that raises makes torch.multiprocessing terminate the others and raise ProcessRaisedException (re-raised as
    RuntimeError); past the deadline every still running rank is killed."""
    context = mp.start_processes(main, args=(job,), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish in {timeout_s:.0f} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise RuntimeError(f"a rank failed:\n{e}") from None
    finally:
        _kill_all(context.processes)


def _kill_all(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=5)


# -- the process group ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int, timeout_s: float, backend: str = "gloo"):
    """`gloo_group`, or for `backend="fake"` torch's fake process group (no peers, no transport, no worker threads;
    `port` and `timeout_s` unused); always left again."""
    if backend != "fake":
        with gloo_group(rank, world_size, port, timeout_s):
            yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, port: int, timeout_s: float):
    """Join a gloo process group over 127.0.0.1 (rank 0 serves the TCPStore on a loopback socket); on a normal
    exit no rank leaves (tearing the group down) while another still communicates; always leave the group."""
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    with loopback_listener(rank, port) as listener:
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=rank == 0, timeout=timeout,
                              master_listen_fd=listener.fileno() if listener is not None else None)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            yield
            dist.barrier()
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def loopback_listener(rank: int, port: int):
    """Rank 0's rendezvous socket, bound to 127.0.0.1 only (a TCPStore left to itself listens on every
    interface); the store serves on it. The other ranks connect to it and need no socket of their own."""
    if rank != 0:
        yield None
        return
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        listener.listen()
        yield listener
    finally:
        listener.close()


@dataclass
class ReleaseCount:
    """How a rank's collectives ended: `collectives` calls; `waited` of them still had the process group holding
    their tensors when the call returned (the window in which gloo's worker thread would drop the last reference
    later); `timeouts` of them were not released in time."""

    collectives: int = 0
    waited: int = 0
    timeouts: int = 0


def holders(tensors) -> list[int]:
    """References to each tensor and to its storage (C++ ones included)."""
    return ([t._use_count() for t in tensors]
            + [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors])


def wait_released(tensors, before: list[int], count: ReleaseCount, timeout_s: float) -> None:
    """Wait until `tensors` have no more holders than `before` (another thread's references gone)."""
    _wait_until(lambda: all(now <= was for now, was in zip(holders(tensors), before)), count, timeout_s)


def _wait_until(done: Callable[[], bool], count: ReleaseCount, timeout_s: float) -> None:
    """Wait until `done()` (another thread has let go), counted in `count`: `waited` when it was not at once,
    `timeouts` when `timeout_s` passed first."""
    if done():
        return
    count.waited += 1
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            count.timeouts += 1
            return
        time.sleep(1e-5)


def released_call(fn: Callable, tensors: tuple, count: ReleaseCount, timeout_s: float, /, *args, **kwargs):
    """`fn(*args, **kwargs)`, a collective on `tensors`; when it ran synchronously (returned no Work: an async Work
    keeps its tensors by design), it returns only once the process group has let go of them (`wait_released`)."""
    before = holders(tensors)
    work = fn(*args, **kwargs)
    count.collectives += 1
    if work is None:
        wait_released(tensors, before, count, timeout_s)
    return work


# The synchronous collectives a user's FSDP2 script reaches (torch 2.13's DefaultAllGather / DefaultReduceScatter,
# torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, call `dist.all_gather_single` / `reduce_scatter_single`;
# older releases and hand-written loops the `_into_tensor` / `_tensor` ones), looked up on `torch.distributed` at call.
SYNC_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                    "all_reduce", "broadcast")


@contextlib.contextmanager
def collectives_released(count: ReleaseCount, tracker=None, timeout_s: float = 5.0):
    """Inside, every synchronous collective of `SYNC_COLLECTIVES` called through `torch.distributed` returns only once
    the process group has released its tensors (`released_call`), counted in `count`; with the entered `tracker`
    (traces/tracker/ `AllocationTracker`), also once every storage the call itself allocated is freed: gloo's
    reduce-scatter clones its whole input and all-reduces the clone, which its worker thread and the caller's work
    object both hold (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp `reduce_scatter_tensor_coalesced`), so its
    last reference goes on whichever thread lets go last. A program measured as it is (traces/script_run.py, a user's
    script) then has its frees where it drops its references, as traces/distributed.py's `BackendReleased` does for
    the FSDP2 units it builds. It allocates nothing."""
    originals = {name: getattr(dist, name) for name in SYNC_COLLECTIVES if hasattr(dist, name)}

    def released(fn: Callable) -> Callable:
        def call(*args, **kwargs):
            tensors = tuple(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))
            first = len(tracker.records) + 1 if tracker is not None else 0
            work = released_call(fn, tensors, count, timeout_s, *args, **kwargs)
            if work is None and tracker is not None:
                own = {id(r) for r in map(tracker.record_of, tensors) if r is not None}  # the caller's tensors
                made = [tracker.records[k] for k in range(first, len(tracker.records) + 1)]
                copies = [r for r in made if id(r) not in own]
                _wait_until(lambda: all(r.freed for r in copies), count, timeout_s)
            return work
        call.__wrapped__ = fn
        return call

    for name, fn in originals.items():
        setattr(dist, name, released(fn))
    try:
        yield count
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# -- in a rank ------------------------------------------------------------------------------------------------

def batch_tensors(batches) -> tuple:
    """Every tensor of `batches` (the (inputs, targets) micro-batches), what a tracker is told it already knows."""
    return tuple(t for b in batches for t in b)


@contextlib.contextmanager
def tracking(tracker, seed: int, *contexts):
    """torch's RNG seeded with `seed` (alike on every rank), then `tracker` entered, then each of `contexts` (a run's
    own, such as `loss_parallel()`), left in reverse order."""
    torch.manual_seed(seed)
    with tracker, contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield tracker


def train_steps(tracker, model, optimizer, batches, setup: TrainingSetup, autocast: torch.dtype | None = None) -> None:
    """`setup.batch.steps` steps of `setup.batch.grad_accum` micro-batches of `batches` (traces.tracker.training_loop:
    FORWARD and BACKWARD per micro-batch, OPTIMIZER, ZERO_GRAD with setup.optimizer.set_to_none) under `tracker`,
    already entered."""
    training_loop(
        tracker,
        model,
        optimizer,
        batches,
        setup.batch.steps,
        setup.batch.grad_accum,
        setup.optimizer.set_to_none,
        autocast,
    )


def run_metadata(rank: int, world_size: int, model_cfg, setup: TrainingSetup, backend: str = "gloo") -> RunMetadata:
    """What every run's log records of itself: world size, rank, backend, torch version, the model and setup run,
    steps, grad_accum and set_to_none (each run adds its own with `updated`)."""
    return RunMetadata(world_size=world_size, rank=rank, backend=backend, torch_version=torch.__version__,
                       model=as_keys(model_cfg), setup=setup, steps=setup.batch.steps,
                       grad_accum=setup.batch.grad_accum, set_to_none=setup.optimizer.set_to_none)


__all__ = ["Job", "measure_ranks", "spawn_ranks", "process_group", "gloo_group", "loopback_listener", "log_path",
           "free_loopback_port", "LOOPBACK", "ReleaseCount", "holders", "wait_released", "released_call",
           "collectives_released", "batch_tensors", "tracking", "train_steps", "run_metadata"]
