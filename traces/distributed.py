"""Measure every rank of a real data-parallel CPU run: FSDP2, DDP and ZeroRedundancyOptimizer on gloo.

`measure_distributed` spawns `world_size` processes on this machine (traces/harness.py `measure_ranks`:
torch.multiprocessing, "spawn"), joined into one gloo process group over the loopback interface only
(`gloo_group`): the rendezvous TCPStore serves on a socket rank 0 binds to 127.0.0.1 at a port picked
free at run time (MASTER_ADDR=127.0.0.1, MASTER_PORT), and gloo's own connections use the `lo`
interface (GLOO_SOCKET_IFNAME=lo). Each process builds the same reference model
(`traces.reference.build_model`, same seed on every rank, so the replicas start identical), wraps it
for its engine, and runs `traces.tracker.training_loop` (load; steps x (forward, backward),
optimizer.step, zero_grad; the same phases as `run_training_steps`) on its own micro-batch (same
shapes, data seeded by rank) under its own `AllocationTracker(rank=r)`. The logs come back through
`traces.store` JSON files in a temporary directory, one `EventLog` per rank, rank order.

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

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ..models.config import MLPConfig, TrainingSetup, TransformerConfig
from ..simulator.events import Category, EventLog, Phase
from ..simulator.run_metadata import RunMetadata
from .harness import (
    ReleaseCount,
    batch_tensors,
    free_loopback_port,
    holders,
    measure_ranks,
    released_call,
    run_metadata,
    tracking,
    train_steps,
    wait_released,
)
from .reference import build_model, make_batch, optimizer_class, torch_optimizer
from .tracker import AllocationTracker, live_bytes, peak

ENGINES = ("fsdp2", "ddp", "zero-redundancy-optimizer")
BACKENDS = ("gloo", "fake")


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
    """Run `setup.batch.steps` real training steps of `model_cfg` on `world_size` CPU processes (gloo, loopback
    only) with `engine` ("fsdp2", "ddp" or "zero-redundancy-optimizer"); one tracked `EventLog` per
    rank, in rank order, every Block carrying its `rank`.

    `setup.batch.micro_batch`, `seq_len`, `grad_accum`, `steps`, `optimizer`, `optimizer_impl`, `precision`
    ("fp32" or "bf16") and `set_to_none` are used; `setup.mesh.world_size` and `zero_stage` are ignored
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
    job = functools.partial(RankJob, model_cfg, setup, world_size, engine, reshard_after_forward,
                            root_reshard_after_forward, seed=seed, timeout_s=timeout_s, backend=backend)
    return measure_ranks(_measure_rank, job, world_size, f"{engine} x {world_size} ranks", prefix="peakledger-dist-",
                         backend=backend)


def _check(setup: TrainingSetup, world_size: int, engine: str, backend: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown process-group backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2, got {world_size}")
    if not setup.precision.uniform:
        raise NotImplementedError(f"distributed measurement runs fp32 or pure bf16, not {setup.precision.name!r}")
    optimizer_class(setup)  # refuses an optimizer torch.optim does not have before any process starts
    if setup.checkpointing.policy != "none" or setup.optimizer.frozen:
        raise NotImplementedError("distributed measurement runs without checkpointing or frozen parameters")
    if setup.offload.mode != "none" and engine == "zero-redundancy-optimizer":
        raise NotImplementedError("the optimizer-state offload wraps FSDP2's and DDP's optimizers, not "
                                  "ZeroRedundancyOptimizer's local one")


# -- one rank -----------------------------------------------------------------------------------------

def _measure_rank(rank: int, job: RankJob) -> EventLog:
    """One rank's run (traces/harness.py `measure_ranks` runs it in a spawned process, in the process group)."""
    model = build_model(job.model_cfg, job.setup, seed=job.seed)  # identical replicas on every rank
    batches = make_batch(job.model_cfg, job.setup, seed=job.seed + 1 + rank)
    engine = ENGINE_BUILDERS[job.engine]
    prepared = engine.before_tracking(model, job)
    tracker = AllocationTracker(prepared.tracked_model, prepared.tracked_optimizer, known=batch_tensors(batches),
                                rank=rank, ddp_buckets=engine.ddp_buckets)
    with tracking(tracker, job.seed):
        run = engine.inside_tracking(prepared, tracker, job)
        train_steps(tracker, run.model, run.optimizer, batches, job.setup)
    details = dict(run.details)
    if prepared.release is not None:
        details["backend_release"] = dataclasses.asdict(prepared.release)
    return tracker.log(_metadata(rank, job, details))


def _metadata(rank: int, job: RankJob, details: dict) -> RunMetadata:
    fsdp = job.engine == "fsdp2"
    return run_metadata(rank, job.world_size, job.model_cfg, job.setup, job.backend).updated(
        engine=job.engine, reshard_after_forward=job.reshard_after_forward if fsdp else None,
        root_reshard_after_forward=job.root_reshard_after_forward if fsdp else None,
        model_kind=type(job.model_cfg).__name__, **details)


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
    """What the training loop calls, and the per-engine metadata (`details`: RunMetadata fields by name)."""

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
        return released_call(inner, (kwargs["output_tensor"], kwargs["input_tensor"]), count,
                             BackendReleased.TIMEOUT_S, **kwargs)


def unit_params(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each FSDP2 unit (module path, the root as "model") with the parameters it shards."""
    names = {id(p): n for n, p in model.named_parameters()}
    units = {}
    for path, module in model.named_modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            units[path or "model"] = [names[id(fp.sharded_param)] for g in groups for fp in g.fsdp_params]
    return units


def fsdp_details(model: torch.nn.Module, reshard_after_forward: bool, release: ReleaseCount) -> dict:
    """What a run's metadata records of FSDP2 applied to `model` by `apply_fsdp2` on a sub-mesh (traces/mesh_run.py,
    traces/context_run.py), as RunMetadata fields by name: the engine, the blocks' `reshard_after_forward`, the units
    and how their collectives were released."""
    return {"dp_engine": "fsdp2", "reshard_after_forward": reshard_after_forward, "fsdp_units": unit_params(model),
            "backend_release": dataclasses.asdict(release)}


class DDP:
    """DistributedDataParallel built inside the tracker (its buckets and initial broadcast are seen)."""

    ddp_buckets = True

    @classmethod
    def before_tracking(cls, model: torch.nn.Module, job: RankJob) -> Prepared:
        optimizer = torch_optimizer(model.parameters(), job.setup, job.lr)  # its state is created lazily
        return Prepared(model, optimizer, model, optimizer)

    @classmethod
    def inside_tracking(cls, prepared: Prepared, tracker, job: RankJob) -> Running:
        wrapped = wrap_ddp(prepared.model, tracker, fake=job.backend == "fake")
        return Running(wrapped, prepared.optimizer, cls.details(prepared, wrapped))

    @staticmethod
    def details(prepared: Prepared, wrapped) -> dict:
        return {"ddp_bucket_cap_bytes": int(wrapped.bucket_bytes_cap)}


def wrap_ddp(model: torch.nn.Module, tracker, *, ignored: list[str] | None = None,
             fake: bool = False) -> DistributedDataParallel:
    """`DistributedDataParallel(model)` built inside the entered `tracker` (Phase.LOAD, scope "ddp.init": the
    broadcast of rank 0's state and the buckets are seen), leaving the parameters named in `ignored` alone
    (traces/expert_run.py: the experts), its all-reduce on torch's fake group by `fake_group_allreduce_hook` when
    `fake`; the wrapper's own forward work (buffer broadcast, bucket rebuild) named "ddp"."""
    with tracker.phase(Phase.LOAD), tracker.scope("ddp.init"):
        if ignored:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        wrapped = DistributedDataParallel(model)
        if fake:
            wrapped.register_comm_hook(None, fake_group_allreduce_hook)
    tracker.name_module(wrapped, "ddp")
    return wrapped


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
    return EventLog(events=events, source=log.source, metadata=log.metadata.updated(backend_copies="removed"),
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
    rank = event.block.rank if log.metadata.rank is None else log.metadata.rank
    return RankPeak(rank=rank, nbytes=nbytes, index=index,
                    phase=event.phase, step=event.step, op=event.op, block=event.block.name,
                    by_category=live_bytes(log, index))


__all__ = ["measure_distributed", "ENGINES", "BACKENDS", "free_loopback_port", "fsdp_units", "transformer_blocks",
           "apply_fsdp2", "wrap_released", "unit_params", "fsdp_details", "wrap_ddp", "RankJob", "BackendReleased",
           "ReleaseCount", "holders", "wait_released", "without_backend_copies", "RankPeak", "rank_peak"]
