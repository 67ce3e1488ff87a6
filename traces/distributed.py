"""Measure every rank of a real data-parallel CPU run: FSDP2, DDP and ZeroRedundancyOptimizer on gloo.

`measure_distributed` spawns `world_size` processes on this machine (torch.multiprocessing, "spawn"),
joined into one gloo process group over the loopback interface only: the rendezvous TCPStore serves
on a socket rank 0 binds to 127.0.0.1 at a port picked free at run time (MASTER_ADDR=127.0.0.1,
MASTER_PORT), and gloo's own connections use the `lo` interface (GLOO_SOCKET_IFNAME=lo). Each
process builds the same reference model (`traces.reference.build_model`, same seed on every rank, so
the replicas start identical), wraps it for its engine, and runs `traces.tracker.training_loop`
(load; steps x (forward, backward), optimizer.step, zero_grad; the same phases as
`run_training_steps`) on its own micro-batch (same shapes, data seeded by rank) under its own
`AllocationTracker(rank=r)`. The logs come back through `traces.store` JSON files in a temporary
directory, one `EventLog` per rank, rank order.

Engines
-------
- "fsdp2": `torch.distributed.fsdp.fully_shard` on each transformer block (`transformer.h[i]` for
  GPT-2, `model.layers[i]` for Llama; each Linear for the MLP), then on the root, with
  `reshard_after_forward` (`apply_fsdp2`, which traces/mesh_run.py applies on its "dp" sub-mesh); the
  optimizer is built after sharding, over the DTensor parameters.
  The tracker labels shards, unsharded parameters, all-gather and reduce-scatter buffers
  (fsdp_labels.py `FSDPLabels`). Each unit's collectives return only once the process group has released
  their tensors (`BackendReleased`: gloo's worker thread otherwise drops the last reference to a
  buffer FSDP2 has already let go of at a moment that varies run to run).
- "ddp": `DistributedDataParallel` with its defaults (gradients are not bucket views; one bucket of
  every parameter at construction, rebuilt in the second forward in gradient-ready order: a first
  bucket closed at 1 MiB, then 25 MiB ones), the ZeRO-0 baseline. The wrapper is built inside the
  tracker (Phase.LOAD, named "ddp.init"), so the buckets and the broadcast of the initial state are
  seen; the buckets are labelled `ddp.bucket.<k>`, the wrapper's own forward work "ddp".
- "zero-redundancy-optimizer": the DDP model plus `ZeroRedundancyOptimizer(params, optimizer_class=
  <the setup's torch.optim class>, **its flags)`: whole parameters are assigned to ranks greedily by
  size (largest first, to the rank holding the fewest elements); each rank keeps optimizer state for
  its own parameters only and broadcasts them to the others after its step.

Backends: "gloo" (the real transport) or "fake" (torch's fake process group: one process per rank as
well, no peers, no data moved, no worker threads). Both give the same event sequence, rank by rank,
once gloo's own reduce-scatter copies are dropped (`without_backend_copies`); on "fake", DDP's
all-reduce runs through `fake_group_allreduce_hook`, as the fake group's work carries no result.

Every rank's metadata records the engine, world size, rank, backend, the model and setup, and per
engine: the FSDP units and their parameters, and how their collectives were released
(`backend_release`, a `ReleaseCount`); the ZeRO owner of each parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..models.config import MLPConfig, TrainingSetup, TransformerConfig
from ..simulator.events import Category, EventLog, Phase
from .reference import build_model, make_batch, optimizer_class, torch_optimizer
from .store import load_log, save_log
from .tracker import AllocationTracker, live_bytes, peak, training_loop

ENGINES = ("fsdp2", "ddp", "zero-redundancy-optimizer")
BACKENDS = ("gloo", "fake")
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RankJob:
    """What every process of one distributed measurement runs (picklable: sent to each spawned rank)."""

    model_cfg: TransformerConfig | MLPConfig
    setup: TrainingSetup
    world_size: int
    engine: str
    reshard_after_forward: bool
    root_reshard_after_forward: bool | None
    port: int
    out_dir: str
    seed: int = 0
    lr: float = 1e-3
    timeout_s: float = 60.0
    backend: str = "gloo"


def measure_distributed(model_cfg: TransformerConfig | MLPConfig, setup: TrainingSetup, world_size: int,
                        engine: str, reshard_after_forward: bool = True, *,
                        root_reshard_after_forward: bool | None = None, seed: int = 0,
                        timeout_s: float = 120.0, backend: str = "gloo") -> list[EventLog]:
    """Run `setup.steps` real training steps of `model_cfg` on `world_size` CPU processes (gloo, loopback
    only) with `engine` ("fsdp2", "ddp" or "zero-redundancy-optimizer"); one tracked `EventLog` per
    rank, in rank order, every Block carrying its `rank`.

    `setup.micro_batch`, `seq_len`, `grad_accum`, `steps`, `optimizer`, `optimizer_impl`, `precision`
    ("fp32" or "bf16") and `set_to_none` are used; `setup.world_size` and `zero_stage` are ignored
    (`world_size` and `engine` say how the run is distributed). FSDP2: `reshard_after_forward` is given
    to every block unit; the root unit gets `root_reshard_after_forward`, None being fully_shard's
    default (False for the root: its parameters stay unsharded from forward into backward).
    `backend="fake"` runs each rank against torch's fake process group instead (no peers, no data moved,
    no gloo worker threads): FSDP2, DDP and ZeroRedundancyOptimizer allocate exactly the same buffers.
    Every FSDP2 collective returns only once the process group has let go of its tensors (see
    `BackendReleased`), so the order of frees is FSDP2's own on both backends, run after run.
    Spawned processes re-import the caller's main module: call this under `if __name__ == "__main__":`
    in a script (pytest and imported modules need nothing). Every process is joined within
    `timeout_s` seconds, or all are killed and TimeoutError is raised; a failing rank's traceback is
    raised as RuntimeError.
    """
    _check(setup, world_size, engine, backend)
    with tempfile.TemporaryDirectory(prefix="peakledger-dist-") as tmp:
        job = RankJob(model_cfg=model_cfg, setup=setup, world_size=world_size, engine=engine,
                      reshard_after_forward=reshard_after_forward,
                      root_reshard_after_forward=root_reshard_after_forward, port=free_loopback_port(),
                      out_dir=tmp, seed=seed, timeout_s=timeout_s, backend=backend)
        _spawn_and_join(job)
        return [load_log(_log_path(tmp, r)) for r in range(world_size)]


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; the socket is closed again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _check(setup: TrainingSetup, world_size: int, engine: str, backend: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown process-group backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2, got {world_size}")
    if setup.precision not in ("fp32", "bf16"):
        raise NotImplementedError(f"distributed measurement runs fp32 or pure bf16, not {setup.precision!r}")
    optimizer_class(setup)  # refuses an optimizer torch.optim does not have before any process starts
    if setup.checkpointing != "none" or setup.frozen:
        raise NotImplementedError("distributed measurement runs without checkpointing or frozen parameters")
    if setup.optimizer_offload != "none" and engine == "zero-redundancy-optimizer":
        raise NotImplementedError("the optimizer-state offload wraps FSDP2's and DDP's optimizers, not "
                                  "ZeroRedundancyOptimizer's local one")


def _log_path(out_dir: str, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.json"


def _spawn_and_join(job: RankJob) -> None:
    spawn_ranks(_rank_main, job, job.world_size, job.timeout_s, f"{job.engine} x {job.world_size} ranks")


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


# -- one rank -----------------------------------------------------------------------------------------

def _rank_main(rank: int, job: RankJob) -> None:
    """The body of one spawned process: join the group, run, save the log, always leave the group."""
    if job.backend == "fake":  # torch's fake process group: no peers, no transport, no worker threads
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=job.world_size)
        try:
            save_log(_measure_rank(rank, job), _log_path(job.out_dir, rank))
        finally:
            dist.destroy_process_group()
        return
    with gloo_group(rank, job.world_size, job.port, job.timeout_s):
        save_log(_measure_rank(rank, job), _log_path(job.out_dir, rank))


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, port: int, timeout_s: float):
    """Join a gloo process group over 127.0.0.1 (rank 0 serves the TCPStore on a loopback socket); on a normal
    exit no rank leaves (tearing the group down) while another still communicates; always leave the group."""
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    with _loopback_listener(rank, port) as listener:
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=rank == 0, timeout=timeout,
                              master_listen_fd=listener.fileno() if listener is not None else None)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            yield
            dist.barrier()
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def _loopback_listener(rank: int, port: int):
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


def _measure_rank(rank: int, job: RankJob) -> EventLog:
    torch.set_num_threads(1)
    setup = job.setup
    model = build_model(job.model_cfg, setup, seed=job.seed)  # identical replicas on every rank
    batches = make_batch(job.model_cfg, setup, seed=job.seed + 1 + rank)
    known = tuple(t for b in batches for t in b)
    engine = ENGINE_BUILDERS[job.engine]
    prepared = engine.before_tracking(model, job)
    tracker = AllocationTracker(prepared.tracked_model, prepared.tracked_optimizer, known=known, rank=rank,
                                ddp_buckets=engine.ddp_buckets)
    torch.manual_seed(job.seed)
    with tracker:
        run = engine.inside_tracking(prepared, tracker, job)
        training_loop(tracker, run.model, run.optimizer, batches, setup.steps, setup.grad_accum,
                      setup.set_to_none)
    details = dict(run.details)
    if prepared.release is not None:
        details["backend_release"] = dataclasses.asdict(prepared.release)
    return tracker.log(_metadata(rank, job, details))


def _metadata(rank: int, job: RankJob, details: dict) -> dict:
    return {"engine": job.engine, "world_size": job.world_size, "rank": rank,
            "reshard_after_forward": job.reshard_after_forward if job.engine == "fsdp2" else None,
            "root_reshard_after_forward": job.root_reshard_after_forward if job.engine == "fsdp2" else None,
            "backend": job.backend, "torch_version": torch.__version__,
            "model": dataclasses.asdict(job.model_cfg), "model_kind": type(job.model_cfg).__name__,
            "setup": dataclasses.asdict(job.setup), "steps": job.setup.steps,
            "grad_accum": job.setup.grad_accum, "set_to_none": job.setup.set_to_none, **details}


# -- engines ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prepared:
    """What the tracker labels: the module whose parameters are named, the optimizer whose state is read
    (the local one for ZeRO), plus what the engine needs to finish inside the tracker."""

    tracked_model: torch.nn.Module
    tracked_optimizer: torch.optim.Optimizer | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    release: "ReleaseCount | None" = None


@dataclass(frozen=True)
class Running:
    """What the training loop calls, and the per-engine metadata."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    details: dict


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that each become one FSDP2 unit before the root: transformer blocks (`transformer_blocks`:
    of a reference GPT or of a pipeline stage cut from one), or MLP Linears; a traced model's repeated blocks
    (traces/reference/traced.py `real_model` names them)."""
    if getattr(model, "peakledger_layers", None):
        return [model.get_submodule(name) for name in model.peakledger_layers]
    if hasattr(model, "transformer") or hasattr(model, "model"):
        return transformer_blocks(model)
    return [m for m in model.layers if isinstance(m, torch.nn.Linear)]


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a reference GPT (`transformer.h` for GPT-2, `model.layers` for Llama: a
    ModuleList) or of a pipeline stage cut from one (traces/pipeline_run.py `StageModule`: a ModuleDict keyed by
    the blocks' indices in the whole model), in order."""
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return list(blocks.values() if isinstance(blocks, torch.nn.ModuleDict) else blocks)


def apply_fsdp2(model: torch.nn.Module, reshard_after_forward: bool, root_reshard_after_forward: bool | None = None,
                *, mesh=None, release: "ReleaseCount | None" = None) -> "ReleaseCount":
    """`fully_shard` on each of `model`'s `fsdp_units` with `reshard_after_forward`, then on `model` as the root
    with `root_reshard_after_forward` (None: fully_shard's default), over `mesh` (None: fully_shard's default,
    the whole world; a "dp" sub-mesh in a device-mesh run); every unit's collectives then released by the
    process group before they return (`wrap_released`), counted in `release` (a new `ReleaseCount` when None),
    which is returned."""
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard_after_forward)
    return wrap_released(model, ReleaseCount() if release is None else release)


def wrap_released(model: torch.nn.Module, release: "ReleaseCount") -> "ReleaseCount":
    """Every FSDP2 unit of `model` with its all-gather and reduce-scatter returning only once the process group
    has released their tensors (`BackendReleased`), counted in `release`, which is returned. The tracker's
    labelling comms (fsdp_labels.py `FSDPLabels`) wrap these."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule) and unit._get_fsdp_state()._fsdp_param_groups:
            group = unit._get_fsdp_state()._fsdp_param_groups[0]
            unit.set_custom_all_gather(BackendReleased.all_gather(group._all_gather_comm, release))
            unit.set_custom_reduce_scatter(BackendReleased.reduce_scatter(group._reduce_scatter_comm, release))
    return release


class FSDP2:
    """fully_shard per block (or Linear), then the root; the optimizer over the sharded parameters. Each
    unit's all-gather and reduce-scatter return only once the process group has released their tensors
    (`BackendReleased`)."""

    ddp_buckets = False

    @staticmethod
    def before_tracking(model: torch.nn.Module, job: RankJob) -> Prepared:
        """`apply_fsdp2` over the whole world, then the optimizer over the sharded parameters."""
        release = apply_fsdp2(model, job.reshard_after_forward, job.root_reshard_after_forward)
        optimizer = torch_optimizer(model.parameters(), job.setup, job.lr)
        return Prepared(model, optimizer, model, optimizer, release)

    @staticmethod
    def inside_tracking(prepared: Prepared, tracker, job: RankJob) -> Running:
        return Running(prepared.model, prepared.optimizer, {"fsdp_units": unit_params(prepared.model)})


@dataclass
class ReleaseCount:
    """How FSDP2's collectives on one rank ended: `collectives` calls; `waited` of them still had the
    process group holding their tensors when the call returned (the window in which gloo's worker
    thread would drop the last reference later); `timeouts` of them were not released in time."""

    collectives: int = 0
    waited: int = 0
    timeouts: int = 0


class BackendReleased:
    """An FSDP2 comm (`AllGather` / `ReduceScatter`, torch/distributed/fsdp/_fully_shard/_fsdp_api.py)
    that delegates to `inner` and, when the collective was synchronous, returns only once the process
    group no longer holds its output and input tensors.

    Why: ProcessGroupGloo runs every collective on a worker thread that keeps the work (which holds the
    collective's tensors) until after it has completed the work's future
    (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, `ProcessGroupGloo::runLoop`:
    `AsyncWork::execute(work)`, then `workInProgress_[workerIndex].reset()` under the lock).
    `work.wait()` returns on the caller at that completion, and the worker's reference goes a moment
    later. If FSDP2 has dropped its own reference by then (`FSDPParamGroup.wait_for_unshard`:
    `self._all_gather_result = None`, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), the
    buffer is freed on the gloo thread at an arbitrary point of the rank's program, in some runs after
    `pre_backward`'s `_backward_prefetch` has allocated the next unit's all-gather output: one buffer
    more at the peak. FSDP2's hooks themselves always run on the calling thread: on the CPU the
    autograd engine drives the whole backward on the thread that called it
    (torch/csrc/autograd/engine.cpp, `Engine::execute_with_graph_task`: `thread_main(graph_task)` on the
    caller for CPU work; device threads serve CUDA and other accelerators only), so
    `torch.autograd.set_multithreading_enabled(False)` changes nothing here.

    Waiting for the release makes every free happen where FSDP2 drops its reference, whatever the
    transport: FSDP2's program order, the one the simulator models (models/parallel/fsdp.py `FSDP2`: in
    backward a unit's pre-backward copies out and frees its all-gather output, then the prefetch
    allocates the next unit's). It allocates nothing. The use counts of the tensors and of their
    storage (`Tensor._use_count`, `torch._C._storage_Use_Count`: C++ references included) back at
    their value before the call mean the process group holds none of them any more.
    """

    TIMEOUT_S = 5.0

    @staticmethod
    def all_gather(inner, count: ReleaseCount):
        class ReleasedAllGather(AllGather):
            def allocate(self, size, *, dtype, device):
                return inner.allocate(size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                return BackendReleased.call(inner, count, output_tensor=output_tensor, input_tensor=input_tensor,
                                            group=group, async_op=async_op)

        return ReleasedAllGather()

    @staticmethod
    def reduce_scatter(inner, count: ReleaseCount):
        class ReleasedReduceScatter(ReduceScatter):
            def allocate(self, size, *, dtype, device):
                return inner.allocate(size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                return BackendReleased.call(inner, count, output_tensor=output_tensor, input_tensor=input_tensor,
                                            group=group, op=op, async_op=async_op)

        return ReleasedReduceScatter()

    @staticmethod
    def call(inner, count: ReleaseCount, **kwargs):
        tensors = (kwargs["output_tensor"], kwargs["input_tensor"])
        before = holders(tensors)
        work = inner(**kwargs)
        count.collectives += 1
        if work is None:  # synchronous: the collective has completed; an async Work keeps its tensors by design
            wait_released(tensors, before, count, BackendReleased.TIMEOUT_S)
        return work


def holders(tensors) -> list[int]:
    """References to each tensor and to its storage (C++ ones included)."""
    return ([t._use_count() for t in tensors]
            + [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors])


def wait_released(tensors, before: list[int], count: ReleaseCount, timeout_s: float) -> None:
    """Wait until `tensors` have no more holders than `before` (another thread's references gone)."""
    if all(now <= was for now, was in zip(holders(tensors), before)):
        return
    count.waited += 1
    deadline = time.monotonic() + timeout_s
    while any(now > was for now, was in zip(holders(tensors), before)):
        if time.monotonic() > deadline:
            count.timeouts += 1
            return
        time.sleep(1e-5)


def unit_params(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each FSDP2 unit (module path, the root as "model") with the parameters it shards."""
    names = {id(p): n for n, p in model.named_parameters()}
    units = {}
    for path, module in model.named_modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            units[path or "model"] = [names[id(fp.sharded_param)] for g in groups for fp in g.fsdp_params]
    return units


class DDP:
    """DistributedDataParallel built inside the tracker (its buckets and initial broadcast are seen)."""

    ddp_buckets = True

    @classmethod
    def before_tracking(cls, model: torch.nn.Module, job: RankJob) -> Prepared:
        optimizer = torch_optimizer(model.parameters(), job.setup, job.lr)  # its state is created lazily
        return Prepared(model, optimizer, model, optimizer)

    @classmethod
    def inside_tracking(cls, prepared: Prepared, tracker, job: RankJob) -> Running:
        with tracker.phase(Phase.LOAD), tracker.scope("ddp.init"):
            wrapped = DistributedDataParallel(prepared.model)  # broadcasts rank 0's state, builds the buckets
            if job.backend == "fake":
                wrapped.register_comm_hook(None, fake_group_allreduce_hook)
        tracker.name_module(wrapped, "ddp")  # its forward: buffer broadcast, bucket rebuild
        return Running(wrapped, prepared.optimizer, cls.details(prepared, wrapped))

    @staticmethod
    def details(prepared: Prepared, wrapped) -> dict:
        return {"ddp_bucket_cap_bytes": int(wrapped.bucket_bytes_cap)}


def fake_group_allreduce_hook(process_group, bucket):  # unannotated: DDP checks annotations by value
    """DDP's gradient all-reduce on torch's fake process group: torch's reference `allreduce_hook`
    (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py: divide the bucket by the world size in
    place, all-reduce it) with the bucket itself as the result. The fake group's work completes with no
    value, and DDP's reducer asserts that a hook's result is a tensor (torch/csrc/distributed/c10d/
    comm.cpp, `parseHookResult`); gloo's and NCCL's all-reduce complete with the bucket they reduced in
    place, so the memory is the same: nothing allocated, the bucket reused."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    dist.all_reduce(buffer, group=group)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


class ZeRO(DDP):
    """DDP plus ZeroRedundancyOptimizer; the tracker reads the state of each rank's local optimizer."""

    @classmethod
    def before_tracking(cls, model: torch.nn.Module, job: RankJob) -> Prepared:
        cls, kwargs = optimizer_class(job.setup)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, lr=job.lr, **kwargs)
        return Prepared(model, zero.optim, model, zero)

    @staticmethod
    def details(prepared: Prepared, wrapped) -> dict:
        names = {id(p): n for n, p in prepared.model.named_parameters()}
        owner = {names[id(p)]: r for p, r in prepared.optimizer._param_to_rank.items()}
        return {"ddp_bucket_cap_bytes": int(wrapped.bucket_bytes_cap), "zero_owner": owner}


ENGINE_BUILDERS = {"fsdp2": FSDP2, "ddp": DDP, "zero-redundancy-optimizer": ZeRO}


# -- reading the logs ---------------------------------------------------------------------------------

BACKEND_COPY = ".backend_copy"


def without_backend_copies(log: EventLog) -> EventLog:
    """`log` without the process group's own copies (blocks named `*.backend_copy`). gloo's
    reduce-scatter all-reduces a clone of its whole input and copies this rank's chunk out; when that
    clone is freed depends on gloo's worker threads, so it can land at a different moment run to run
    and rank to rank. NCCL has no such copy; FSDP2's own buffers are what remains."""
    events = [e for e in log.events if not e.block.name.endswith(BACKEND_COPY)]
    return EventLog(events=events, source=log.source, metadata={**log.metadata, "backend_copies": "removed"},
                    ooms=log.ooms, op_names=log.op_names)


@dataclass(frozen=True)
class RankPeak:
    """Where one rank's live bytes first reach their maximum, and what is live there by category."""

    rank: int
    nbytes: int
    index: int
    phase: Phase
    step: int
    op: str
    block: str
    by_category: dict[Category, int]


def rank_peak(log: EventLog) -> RankPeak:
    nbytes, index = peak(log)
    event = log.events[index]
    return RankPeak(rank=log.metadata.get("rank", event.block.rank), nbytes=nbytes, index=index,
                    phase=event.phase, step=event.step, op=event.op, block=event.block.name,
                    by_category=live_bytes(log, index))


__all__ = ["measure_distributed", "ENGINES", "BACKENDS", "free_loopback_port", "fsdp_units", "transformer_blocks",
           "apply_fsdp2", "wrap_released", "unit_params", "RankJob", "BackendReleased", "ReleaseCount", "holders",
           "wait_released", "without_backend_copies", "RankPeak", "rank_peak"]
