"""Measure every rank of a real multi-dimensional (device-mesh) CPU run: FSDP2 x TP (2D), TP x PP, FSDP2 x PP and
FSDP2 x TP x PP, on gloo over 127.0.0.1, one tracked `EventLog` per global rank.

`measure_mesh` spawns `setup.mesh.world_size` processes joined as every real run joins its ranks (traces/harness.py
`measure_ranks`: a TCPStore rank 0 binds to 127.0.0.1 at a free port, gloo on `lo`), and every process builds the
device mesh torchtitan's ParallelDims builds,

    init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))   # dimensions of size 1 left out

so that global rank = (pp_i x dp + dp_i) x tp + tp_i (tp innermost: the ranks of one tensor-parallel group are
neighbours). Every rank builds the same reference model (`traces.reference.build_model`, same seed).

Layouts
-------
- 2D, FSDP2 + TP (pp = 1, dp > 1, dp_engine "fsdp2"), torchtitan's order (models/llama3/infra/parallelize.py:
  `apply_tp`, then `apply_fsdp`): traces/tensor_run.py `parallelize` on the "tp" sub-mesh (its `tp_plan`,
  attention on local heads, a tied embedding re-tied), then `fully_shard` on each transformer block and on the
  root with the "dp" sub-mesh, traces/distributed.py's `apply_fsdp2` as its FSDP2 engine applies it (its
  `fsdp_units`; every block with `setup.data_parallel.fsdp2.reshard_after_forward`, the root with fully_shard's default;
  each unit's collectives return once gloo has let go of their tensors: `wrap_released`, `BackendReleased`). The
  optimizer takes tensor_run's `optimizer_groups` (one group per device mesh). The loop is
  `traces.tracker.training_loop` under `loss_parallel()`, as tensor_run runs it (`grad_accum` micro-batches per
  step, each a FORWARD and a BACKWARD with its micro-batch index, then OPTIMIZER and ZERO_GRAD).
- TP + PP (dp = 1, pp > 1): the stages of the pipeline rank (traces/pipeline_run.py `stage_modules`,
  `StageModule`s in the layout of models/parallel/stages.py `rank_stages`), each stage module
  tensor-parallelized on the "tp" sub-mesh by tensor_run's `parallelize` (the entries of `tp_plan` that name one
  of its modules; no tie to restore: a stage holds the embedding or the head, never both once pp > 1), wrapped
  in a `PipelineStage` whose peers are the "pp" sub-mesh's group (pipeline_run's `build_pipeline`, with
  `group` and the local sequence length), scheduled by `setup.mesh.pp_schedule` (gpipe, 1f1b,
  interleaved-1f1b) over `setup.batch.grad_accum` micro-batches with the reference cross-entropy as loss_fn; the
  whole step runs under `loss_parallel()` (torchtitan's train context does the same around
  `pp_schedule.step`): the last stage's logits stay vocabulary-sharded DTensors and the loss is computed on
  the shards. The activations between stages are the tensor-parallel rank's local tensors: (B, T, D), or
  (B, T / tp, D) with sequence parallelism (a Llama stage takes the whole sequence length for its rotary tables
  and causal mask from `StageModule.seq_len`). Steps run and are labelled as in pipeline_run
  (`run_pipeline_steps`; `label_pipeline`: `label_stage`, `label_loss`: each stage's forward and backward of a
  micro-batch FORWARD / BACKWARD with that micro-batch, the schedule's own work FORWARD with micro-batch -1,
  then OPTIMIZER and ZERO_GRAD).
- FSDP2 x PP and FSDP2 x TP x PP (dp > 1, pp > 1, dp_engine "fsdp2"): as torchtitan applies FSDP2 to each model
  part, each stage module (tensor-parallelized first when tp > 1) gets `fully_shard` on its blocks
  (`setup.data_parallel.fsdp2.reshard_after_forward`) and then on itself as the root (fully_shard's default), with the
  "dp" sub-mesh (`apply_fsdp2`: a stage's `fsdp_units` are its blocks); PipelineStage drives the FSDP2 root (no
  reduce-scatter before the last micro-batch's backward, whose post-backward then reduce-scatters the
  accumulated unsharded gradients).

Data: every data-parallel rank trains on its own micro-batches (`make_batch(seed = seed + 1 + dp_i)`: dp_i = 0
is the data tensor_run and pipeline_run use); the tensor-parallel ranks of one group read the same data.

The tracker is tensor_run's `DTensorTracker` (it sees the plain ops DTensor runs on local shards, and makes
gloo's frees after a functional collective land where DTensor drops its references), `rank` = the global rank
on every Block. Metadata: what tensor_run / pipeline_run / distributed record (engine details, tp,
sequence_parallel, pp, pp_schedule, stages, FSDP2 units, backend_release), plus `mesh`: this rank's
coordinates {"pp": i, "dp": j, "tp": k} (every dimension, size-1 ones at 0) and `mesh_shape`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ..models.config import TrainingSetup, TransformerConfig
from ..models.families import family_of
from ..models.parallel.stages import rank_stages, stage_layout
from ..simulator.events import EventLog
from ..simulator.run_metadata import RunMetadata
from .distributed import apply_fsdp2, fsdp_details
from .harness import Job, batch_tensors, measure_ranks, run_metadata, tracking, train_steps
from .pipeline_run import SCHEDULES, build_pipeline, stage_modules, stage_records, train_pipeline
from .reference import build_model, make_batch, optimizer_class, torch_optimizer
from .tensor_run import DTensorTracker, optimizer_groups, parallelize

MESH_DIMS = ("pp", "dp", "tp")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class MeshJob(Job):
    """What every process of a mesh run is sent: the harness's job (the whole setup says the layout), with
    measure_mesh's longer default timeout."""

    timeout_s: float = 180.0


def measure_mesh(model_cfg: TransformerConfig, setup: TrainingSetup, *, seed: int = 0,
                 timeout_s: float = 180.0) -> list[EventLog]:
    """Run `setup.batch.steps` real training steps of `model_cfg` on `setup.mesh.world_size` CPU processes laid out as a
    (pp, dp, tp) device mesh (gloo, loopback only); one tracked `EventLog` per global rank, in rank order. Uses
    tp, sequence_parallel, pp, pp_schedule, virtual_stages, world_size (dp = world_size / (tp x pp)),
    dp_engine ("fsdp2" when dp > 1), reshard_after_forward, micro_batch, seq_len, grad_accum (micro-batches of
    a step), steps, precision ("fp32" or "bf16"), optimizer, optimizer_impl and set_to_none. Supported: FSDP2 x
    TP (pp = 1), TP x PP (dp = 1), FSDP2 x PP (tp = 1) and FSDP2 x TP x PP; pp_schedule gpipe, 1f1b or
    interleaved-1f1b. Call under `if __name__ == "__main__":` in a script; every process is
    joined within `timeout_s` seconds, else all are killed and TimeoutError is raised; a failing rank's
    traceback is raised as RuntimeError."""
    check_mesh(model_cfg, setup)
    job = functools.partial(MeshJob, model_cfg, setup, seed=seed, timeout_s=timeout_s)
    return measure_ranks(
        _measure_rank, job, setup.mesh.world_size, f"mesh {_describe(setup)}", prefix="peakledger-mesh-"
    )


def mesh_sizes(setup: TrainingSetup) -> dict[str, int]:
    """{"pp": pp, "dp": dp, "tp": tp}: every dimension, outermost first."""
    return {"pp": setup.mesh.pp, "dp": setup.mesh.dp, "tp": setup.mesh.tp}


def mesh_coords(setup: TrainingSetup, rank: int) -> dict[str, int]:
    """The mesh coordinates of global `rank`: rank = (pp_i x dp + dp_i) x tp + tp_i."""
    sizes = mesh_sizes(setup)
    coords = {}
    for name in reversed(MESH_DIMS):
        rank, coords[name] = divmod(rank, sizes[name])
    return {name: coords[name] for name in MESH_DIMS}


def mesh_rank(setup: TrainingSetup, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
    """The global rank at mesh coordinates (pp, dp, tp)."""
    return (pp * setup.mesh.dp + dp) * setup.mesh.tp + tp


def _describe(setup: TrainingSetup) -> str:
    return " x ".join(f"{n}{s}" for n, s in mesh_sizes(setup).items() if s > 1)


def check_mesh(model_cfg, setup: TrainingSetup) -> None:
    """Refuse, before any process starts, what `measure_mesh` does not run (ValueError for a layout that
    cannot be, NotImplementedError for one not measured yet)."""
    if not {"tp", "pp"} <= family_of(model_cfg).parallel:
        raise NotImplementedError("mesh runs use the hand-written dense GPT-2 / Llama reference models "
                                  "(implementation nanogpt, no experts)")
    if setup.mesh.cp != 1 or setup.mesh.ep != 1:
        raise NotImplementedError("mesh runs have no context or expert parallelism: cp 1, ep 1")
    dp, pp = setup.mesh.dp, setup.mesh.pp
    if setup.mesh.tp < 2 and not (dp > 1 and pp > 1):
        raise NotImplementedError(f"mesh runs combine at least two of FSDP2, TP and PP: tp >= 2 (got {setup.mesh.tp}) "
                                  "with dp > 1 or pp > 1, or FSDP2 x PP (dp > 1 and pp > 1); one dimension alone "
                                  "is traces/distributed.py measure_distributed or traces/pipeline_run.py "
                                  "measure_pipeline")
    if dp == 1 and pp == 1:
        raise ValueError(f"tp={setup.mesh.tp} alone is a one-dimensional layout: use traces/tensor_run.py "
                         "measure_tensor_parallel (or give world_size = dp x tp x pp with dp > 1 or pp > 1)")
    if dp > 1 and setup.data_parallel.engine != "fsdp2":
        raise NotImplementedError(f"the data-parallel dimension of a mesh run is FSDP2 (dp_engine fsdp2), "
                                  f"not {setup.data_parallel.engine!r}")
    if setup.data_parallel.deepspeed.zero_stage:
        raise NotImplementedError("mesh runs have no DeepSpeed ZeRO stage: zero_stage 0")
    for what, heads in (("n_head", model_cfg.n_head), ("n_kv_head", model_cfg.kv_heads)):
        if heads % setup.mesh.tp:
            raise ValueError(f"tp={setup.mesh.tp} does not divide {what}={heads}: each tensor-parallel rank holds "
                             "whole heads")
    if setup.mesh.sequence_parallel and setup.batch.seq_len % setup.mesh.tp:
        raise ValueError(
            f"seq_len={setup.batch.seq_len} is not a multiple of tp={setup.mesh.tp} (sequence parallelism)"
        )
    if setup.precision.name not in PRECISIONS:
        raise NotImplementedError(f"mesh runs measure {' or '.join(PRECISIONS)}, not {setup.precision.name!r}")
    if setup.checkpointing.policy != "none" or setup.optimizer.frozen or setup.lora.r or model_cfg.dropout:
        raise NotImplementedError("mesh runs measure without checkpointing, frozen parameters, LoRA or dropout")
    if setup.offload.mode != "none" or setup.checkpoint_io.every or setup.checkpoint_io.load_mode != "none":
        raise NotImplementedError("mesh runs measure without optimizer-state offload or checkpoint saves / loads")
    if setup.batch.passes != "train":
        raise NotImplementedError("mesh runs measure training steps: passes train")
    if pp > 1:
        if setup.mesh.pp_schedule not in SCHEDULES:
            raise NotImplementedError(f"mesh runs schedule {', '.join(SCHEDULES)}, not {setup.mesh.pp_schedule!r}")
        stage_layout(setup, model_cfg.n_layer)  # ConfigError: more stages than n_layer + 2
    optimizer_class(setup)


# -- one process ----------------------------------------------------------------------------------------------

def build_mesh(setup: TrainingSetup):
    """The device mesh of the dimensions larger than 1, outermost first (torchtitan's ParallelDims order)."""
    dims = [(n, s) for n, s in mesh_sizes(setup).items() if s > 1]
    return init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def _measure_rank(rank: int, job: MeshJob) -> EventLog:
    """One rank's run (traces/harness.py `measure_ranks` runs it in a spawned process, in the process group)."""
    mesh = build_mesh(job.setup)
    coords = mesh_coords(job.setup, rank)
    if job.setup.mesh.pp > 1:
        log, details = _measure_pipeline(rank, job, mesh, coords)
    else:
        log, details = _measure_fsdp_tp(rank, job, mesh, coords)
    return log(_metadata(rank, job, coords, details))


def _metadata(rank: int, job: MeshJob, coords: dict, details: dict) -> RunMetadata:
    """The rank's metadata; `details`: its engines' own fields (RunMetadata's, by name)."""
    s = job.setup
    return run_metadata(rank, s.mesh.world_size, job.model_cfg, s).updated(
        engine="mesh",
        mesh=coords,
        mesh_shape=mesh_sizes(s),
        mesh_dim_names=[n for n in MESH_DIMS if mesh_sizes(s)[n] > 1],
        tp=s.mesh.tp,
        sequence_parallel=s.mesh.sequence_parallel,
        dp=s.mesh.dp,
        pp=s.mesh.pp,
        model_kind=type(job.model_cfg).__name__,
        **details,
    )


# -- FSDP2 x TP -----------------------------------------------------------------------------------------------

def _placements(model: nn.Module) -> dict[str, str]:
    """Each parameter's placements and local shape (what FSDP2 and TP made of it)."""
    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[n] = f"{tuple(p.device_mesh.mesh_dim_names or ())} {p.placements} local {tuple(p.to_local().shape)}"
        else:
            out[n] = f"plain {tuple(p.shape)}"
    return out


def _fsdp_details(setup: TrainingSetup, model: nn.Module, release) -> dict:
    """What the metadata records of FSDP2 on the dp sub-mesh (traces/distributed.py `fsdp_details`), the roots with
    fully_shard's default."""
    return {
        **fsdp_details(model, setup.data_parallel.fsdp2.reshard_after_forward, release),
        "root_reshard_after_forward": None,
    }


def _measure_fsdp_tp(rank: int, job: MeshJob, mesh, coords: dict):
    setup = job.setup
    model = build_model(job.model_cfg, setup, seed=job.seed)
    parallelize(model, setup.mesh.tp, setup.mesh.sequence_parallel, mesh=mesh["tp"])
    release = apply_fsdp2(model, setup.data_parallel.fsdp2.reshard_after_forward, mesh=mesh["dp"])
    optimizer = torch_optimizer(optimizer_groups(model), setup, job.lr)
    batches = make_batch(job.model_cfg, setup, seed=job.seed + 1 + coords["dp"])  # the tp group's own data
    tracker = DTensorTracker(model, optimizer, known=batch_tensors(batches), rank=rank)
    with tracking(tracker, job.seed, loss_parallel()):
        train_steps(tracker, model, optimizer, batches, setup)
    details = {"engines": ["dtensor-tp", "fsdp2"], **_fsdp_details(setup, model, release),
               "placements": _placements(model)}
    return tracker.log, details


# -- TP x PP, FSDP2 x PP, FSDP2 x TP x PP ---------------------------------------------------------------------

def _measure_pipeline(rank: int, job: MeshJob, mesh, coords: dict):
    """TP x PP, FSDP2 x PP or FSDP2 x TP x PP as torchtitan builds them (torchtitan/models/llama3/infra/
    parallelize.py applied to each model part): each stage module tensor-parallelized on "tp", then
    `fully_shard` on its blocks and on the stage module itself with "dp" (the stage is the FSDP2 root that
    PipelineStage drives: no gradient sync before the last micro-batch's backward, then its post-backward)."""
    cfg, setup = job.model_cfg, job.setup
    specs = rank_stages(setup, cfg.n_layer, coords["pp"])
    modules, dtype = stage_modules(cfg, setup, specs, job.seed)
    release = None
    for module in modules:
        if setup.mesh.tp > 1:
            parallelize(module, setup.mesh.tp, setup.mesh.sequence_parallel, mesh=mesh["tp"])
        if setup.mesh.dp > 1:  # the stage module is the root (fully_shard's default for a root: kept unsharded)
            release = apply_fsdp2(
                module, setup.data_parallel.fsdp2.reshard_after_forward, mesh=mesh["dp"], release=release
            )
    # between stages: this rank's local activations, (B, T / tp, D) with sequence parallelism
    local_seq_len = setup.batch.seq_len // setup.mesh.tp if setup.mesh.sequence_parallel else setup.batch.seq_len
    stages, schedule, tracked = build_pipeline(modules, specs, cfg, setup, dtype, group=mesh["pp"].get_group(),
                                               local_seq_len=local_seq_len)
    optimizer = torch_optimizer(optimizer_groups(tracked), setup, job.lr)
    batches = make_batch(cfg, setup, seed=job.seed + 1 + coords["dp"])
    tracker = train_pipeline(DTensorTracker, stages, schedule, tracked, optimizer, specs, batches, setup, rank=rank,
                             seed=job.seed, contexts=[loss_parallel()] if setup.mesh.tp > 1 else [])
    engines = ["pipeline"] + (["dtensor-tp"] if setup.mesh.tp > 1 else []) + (["fsdp2"] if setup.mesh.dp > 1 else [])
    fsdp = _fsdp_details(setup, tracked, release) if setup.mesh.dp > 1 else {}
    details = {"engines": engines, **fsdp, "pp_schedule": setup.mesh.pp_schedule,
               "virtual_stages": setup.mesh.virtual_stages, "stages": stage_records(specs),
               "loss_parallel": setup.mesh.tp > 1, "placements": _placements(tracked)}
    return tracker.log, details


__all__ = ["measure_mesh", "check_mesh", "mesh_sizes", "mesh_coords", "mesh_rank", "build_mesh", "MeshJob"]
