"""Measure every rank of a real multi-dimensional (device-mesh) CPU run: FSDP2 x TP (2D), TP x PP, FSDP2 x PP and
FSDP2 x TP x PP, on gloo over 127.0.0.1, one tracked `EventLog` per global rank.

`measure_mesh` spawns `setup.world_size` processes joined as traces/distributed.py joins its ranks
(`spawn_ranks`, `gloo_group`: a TCPStore rank 0 binds to 127.0.0.1 at a free port, gloo on `lo`), and every
process builds the device mesh torchtitan's ParallelDims builds,

    init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))   # dimensions of size 1 left out

so that global rank = (pp_i x dp + dp_i) x tp + tp_i (tp innermost: the ranks of one tensor-parallel group are
neighbours). Every rank builds the same reference model (`models.reference.build_model`, same seed).

Layouts
-------
- 2D, FSDP2 + TP (pp = 1, dp > 1, dp_engine "fsdp2"), torchtitan's order (models/llama3/infra/parallelize.py:
  `apply_tp`, then `apply_fsdp`): traces/tensor_run.py `parallelize` on the "tp" sub-mesh (its `tp_plan`,
  attention on local heads, a tied embedding re-tied), then `fully_shard` on each transformer block and on the
  root with the "dp" sub-mesh, as traces/distributed.py's FSDP2 engine applies it (`fsdp_units`; every block
  with `setup.reshard_after_forward`, the root with fully_shard's default; each unit's collectives return
  once gloo has let go of their tensors: `BackendReleased`). The loop is `traces.tracker.training_loop` under
  `loss_parallel()`, as tensor_run runs it (`grad_accum` micro-batches per step, each a FORWARD and a BACKWARD
  with its micro-batch index, then OPTIMIZER and ZERO_GRAD).
- TP + PP (dp = 1, pp > 1): the stages of the pipeline rank (traces/pipeline_run.py `StageModule`, the layout
  of models/parallel/pipeline.py `rank_stages`), each stage module tensor-parallelized on the "tp" sub-mesh
  with the entries of the whole model's `tp_plan` that name one of its modules, wrapped in a `PipelineStage`
  whose peers are the "pp" sub-mesh's group, scheduled by `setup.pp_schedule` (gpipe, 1f1b,
  interleaved-1f1b) over `setup.grad_accum` micro-batches with the reference cross-entropy as loss_fn; the
  whole step runs under `loss_parallel()` (torchtitan's train context does the same around
  `pp_schedule.step`): the last stage's logits stay vocabulary-sharded DTensors and the loss is computed on
  the shards. The activations between stages are the tensor-parallel rank's local tensors: (B, T, D), or
  (B, T / tp, D) with sequence parallelism. Steps and phases are labelled as pipeline_run labels them
  (`_label_stage`, `_label_loss`: each stage's forward and backward of a micro-batch FORWARD / BACKWARD with
  that micro-batch, the schedule's own work FORWARD with micro-batch -1, then OPTIMIZER and ZERO_GRAD).
- FSDP2 x PP and FSDP2 x TP x PP (dp > 1, pp > 1, dp_engine "fsdp2"): as torchtitan applies FSDP2 to each model
  part, each stage module (tensor-parallelized first when tp > 1) gets `fully_shard` on its blocks
  (`setup.reshard_after_forward`) and then on itself as the root (fully_shard's default), with the "dp"
  sub-mesh; PipelineStage drives the FSDP2 root (no reduce-scatter before the last micro-batch's backward,
  whose post-backward then reduce-scatters the accumulated unsharded gradients).

Data: every data-parallel rank trains on its own micro-batches (`make_batch(seed = seed + 1 + dp_i)`: dp_i = 0
is the data tensor_run and pipeline_run use); the tensor-parallel ranks of one group read the same data.

The tracker is tensor_run's `DTensorTracker` (it sees the plain ops DTensor runs on local shards, and makes
gloo's frees after a functional collective land where DTensor drops its references), `rank` = the global rank
on every Block. Metadata: what tensor_run / pipeline_run / distributed record (engine details, tp,
sequence_parallel, pp, pp_schedule, stages, FSDP2 units, backend_release), plus `mesh`: this rank's
coordinates {"pp": i, "dp": j, "tp": k} (every dimension, size-1 ones at 0) and `mesh_shape`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import types
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..models.config import TrainingSetup, TransformerConfig
from ..simulator.events import Category, EventLog, Phase
from .distributed import free_loopback_port, gloo_group, spawn_ranks
from .store import load_log, save_log

MESH_DIMS = ("pp", "dp", "tp")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class MeshJob:
    model_cfg: TransformerConfig
    setup: TrainingSetup
    port: int
    out_dir: str
    seed: int = 0
    lr: float = 1e-3
    timeout_s: float = 180.0


def measure_mesh(model_cfg: TransformerConfig, setup: TrainingSetup, *, seed: int = 0,
                 timeout_s: float = 180.0) -> list[EventLog]:
    """Run `setup.steps` real training steps of `model_cfg` on `setup.world_size` CPU processes laid out as a
    (pp, dp, tp) device mesh (gloo, loopback only); one tracked `EventLog` per global rank, in rank order. Uses
    tp, sequence_parallel, pp, pp_schedule, virtual_stages, world_size (dp = world_size / (tp x pp)),
    dp_engine ("fsdp2" when dp > 1), reshard_after_forward, micro_batch, seq_len, grad_accum (micro-batches of
    a step), steps, precision ("fp32" or "bf16"), optimizer, optimizer_impl and set_to_none. Supported: FSDP2 x
    TP (pp = 1), TP x PP (dp = 1), FSDP2 x PP (tp = 1) and FSDP2 x TP x PP; pp_schedule gpipe, 1f1b or
    interleaved-1f1b. Call under `if __name__ == "__main__":` in a script; every process is
    joined within `timeout_s` seconds, else all are killed and TimeoutError is raised; a failing rank's
    traceback is raised as RuntimeError."""
    check_mesh(model_cfg, setup)
    with tempfile.TemporaryDirectory(prefix="peakledger-mesh-") as tmp:
        job = MeshJob(model_cfg, setup, free_loopback_port(), tmp, seed=seed, timeout_s=timeout_s)
        spawn_ranks(_rank_main, job, setup.world_size, timeout_s, f"mesh {_describe(setup)}")
        return [load_log(os.path.join(tmp, f"rank{r}.json")) for r in range(setup.world_size)]


def mesh_sizes(setup: TrainingSetup) -> dict[str, int]:
    """{"pp": pp, "dp": dp, "tp": tp}: every dimension, outermost first."""
    return {"pp": setup.pp, "dp": setup.dp, "tp": setup.tp}


def mesh_coords(setup: TrainingSetup, rank: int) -> dict[str, int]:
    """The mesh coordinates of global `rank`: rank = (pp_i x dp + dp_i) x tp + tp_i."""
    sizes = mesh_sizes(setup)
    coords = {}
    for name in reversed(MESH_DIMS):
        rank, coords[name] = divmod(rank, sizes[name])
    return {name: coords[name] for name in MESH_DIMS}


def mesh_rank(setup: TrainingSetup, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
    """The global rank at mesh coordinates (pp, dp, tp)."""
    return (pp * setup.dp + dp) * setup.tp + tp


def _describe(setup: TrainingSetup) -> str:
    return " x ".join(f"{n}{s}" for n, s in mesh_sizes(setup).items() if s > 1)


def check_mesh(model_cfg, setup: TrainingSetup) -> None:
    """Refuse, before any process starts, what `measure_mesh` does not run (ValueError for a layout that
    cannot be, NotImplementedError for one not measured yet)."""
    from ..models.parallel.pipeline import stage_layout
    from ..models.reference import optimizer_class
    from .pipeline_run import SCHEDULES

    if not isinstance(model_cfg, TransformerConfig) or model_cfg.implementation != "nanogpt" \
            or model_cfg.num_local_experts:
        raise NotImplementedError("mesh runs use the hand-written dense GPT-2 / Llama reference models "
                                  "(implementation nanogpt, no experts)")
    if setup.cp != 1 or setup.ep != 1:
        raise NotImplementedError("mesh runs have no context or expert parallelism: cp 1, ep 1")
    dp, pp = setup.dp, setup.pp
    if setup.tp < 2 and not (dp > 1 and pp > 1):
        raise NotImplementedError(f"mesh runs combine at least two of FSDP2, TP and PP: tp >= 2 (got {setup.tp}) "
                                  "with dp > 1 or pp > 1, or FSDP2 x PP (dp > 1 and pp > 1); one dimension alone "
                                  "is traces/distributed.py measure_distributed or traces/pipeline_run.py "
                                  "measure_pipeline")
    if dp == 1 and pp == 1:
        raise ValueError(f"tp={setup.tp} alone is a one-dimensional layout: use traces/tensor_run.py "
                         "measure_tensor_parallel (or give world_size = dp x tp x pp with dp > 1 or pp > 1)")
    if dp > 1 and setup.dp_engine != "fsdp2":
        raise NotImplementedError(f"the data-parallel dimension of a mesh run is FSDP2 (dp_engine fsdp2), "
                                  f"not {setup.dp_engine!r}")
    if setup.zero_stage:
        raise NotImplementedError("mesh runs have no DeepSpeed ZeRO stage: zero_stage 0")
    for what, heads in (("n_head", model_cfg.n_head), ("n_kv_head", model_cfg.kv_heads)):
        if heads % setup.tp:
            raise ValueError(f"tp={setup.tp} does not divide {what}={heads}: each tensor-parallel rank holds "
                             "whole heads")
    if setup.sequence_parallel and setup.seq_len % setup.tp:
        raise ValueError(f"seq_len={setup.seq_len} is not a multiple of tp={setup.tp} (sequence parallelism)")
    if setup.precision not in PRECISIONS:
        raise NotImplementedError(f"mesh runs measure {' or '.join(PRECISIONS)}, not {setup.precision!r}")
    if setup.checkpointing != "none" or setup.frozen or setup.lora_r or model_cfg.dropout:
        raise NotImplementedError("mesh runs measure without checkpointing, frozen parameters, LoRA or dropout")
    if setup.optimizer_offload != "none" or setup.checkpoint_every or setup.load_mode != "none":
        raise NotImplementedError("mesh runs measure without optimizer-state offload or checkpoint saves / loads")
    if setup.passes != "train":
        raise NotImplementedError("mesh runs measure training steps: passes train")
    if pp > 1:
        if setup.pp_schedule not in SCHEDULES:
            raise NotImplementedError(f"mesh runs schedule {', '.join(SCHEDULES)}, not {setup.pp_schedule!r}")
        stage_layout(setup, model_cfg.n_layer)  # ConfigError: more stages than n_layer + 2
    optimizer_class(setup)


# -- one process ----------------------------------------------------------------------------------------------

def _rank_main(rank: int, job: MeshJob) -> None:
    with gloo_group(rank, job.setup.world_size, job.port, job.timeout_s):
        save_log(_measure_rank(rank, job), os.path.join(job.out_dir, f"rank{rank}.json"))


def build_mesh(setup: TrainingSetup):
    """The device mesh of the dimensions larger than 1, outermost first (torchtitan's ParallelDims order)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = [(n, s) for n, s in mesh_sizes(setup).items() if s > 1]
    return init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def _measure_rank(rank: int, job: MeshJob) -> EventLog:
    torch.set_num_threads(1)
    mesh = build_mesh(job.setup)
    coords = mesh_coords(job.setup, rank)
    if job.setup.pp > 1:
        log, details = _measure_pipeline(rank, job, mesh, coords)
    else:
        log, details = _measure_fsdp_tp(rank, job, mesh, coords)
    return log(_metadata(rank, job, coords, details))


def _metadata(rank: int, job: MeshJob, coords: dict, details: dict) -> dict:
    s = job.setup
    return {"engine": "mesh", "world_size": s.world_size, "rank": rank, "mesh": coords,
            "mesh_shape": mesh_sizes(s), "mesh_dim_names": [n for n in MESH_DIMS if mesh_sizes(s)[n] > 1],
            "tp": s.tp, "sequence_parallel": s.sequence_parallel, "dp": s.dp, "pp": s.pp,
            "backend": "gloo", "torch_version": torch.__version__, "model": dataclasses.asdict(job.model_cfg),
            "model_kind": type(job.model_cfg).__name__, "setup": dataclasses.asdict(s), "steps": s.steps,
            "grad_accum": s.grad_accum, "set_to_none": s.set_to_none, **details}


# -- FSDP2 x TP -----------------------------------------------------------------------------------------------

def apply_fsdp2(model: nn.Module, dp_mesh, reshard_after_forward: bool, root_reshard_after_forward=None,
                units: list[nn.Module] | None = None, release=None):
    """traces/distributed.py's FSDP2 engine on the "dp" sub-mesh: `fully_shard` on each of `units` (default:
    its `fsdp_units`, the transformer blocks), then the root; every unit's collectives released by gloo before
    they return (`BackendReleased`), counted in `release` (a new `ReleaseCount` by default), which is returned."""
    from torch.distributed.fsdp import fully_shard

    from .distributed import ReleaseCount, fsdp_units

    for unit in (fsdp_units(model) if units is None else units):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=root_reshard_after_forward)
    return wrap_released(model, ReleaseCount() if release is None else release)


def wrap_released(model: nn.Module, release):
    """Every FSDP2 unit of `model` with its all-gather and reduce-scatter released by gloo before they return
    (traces/distributed.py `BackendReleased`), counted in `release`."""
    from torch.distributed.fsdp import FSDPModule

    from .distributed import BackendReleased

    for unit in model.modules():
        if isinstance(unit, FSDPModule) and unit._get_fsdp_state()._fsdp_param_groups:
            group = unit._get_fsdp_state()._fsdp_param_groups[0]
            unit.set_custom_all_gather(BackendReleased.all_gather(group._all_gather_comm, release))
            unit.set_custom_reduce_scatter(BackendReleased.reduce_scatter(group._reduce_scatter_comm, release))
    return release


def mesh_optimizer_groups(model: nn.Module) -> list[dict]:
    """The parameters as torch.optim groups, one per device mesh (plain tensors last): after FSDP2 x TP the
    tensor-parallel parameters are DTensors on the (dp, tp) mesh, the others on the dp mesh alone, and DTensor's
    foreach kernels take one mesh per call (each group is stepped on its own). Without FSDP2 these are
    tensor_run's `optimizer_groups` (the DTensors, then the plain tensors)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in model.parameters():
        key = id(p.device_mesh) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    plain = groups.pop(None, [])
    return [{"params": g} for g in (*groups.values(), plain) if g]


def _placements(model: nn.Module) -> dict[str, str]:
    """Each parameter's placements and local shape (what FSDP2 and TP made of it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[n] = f"{tuple(p.device_mesh.mesh_dim_names or ())} {p.placements} local {tuple(p.to_local().shape)}"
        else:
            out[n] = f"plain {tuple(p.shape)}"
    return out


def _measure_fsdp_tp(rank: int, job: MeshJob, mesh, coords: dict):
    from torch.distributed.tensor.parallel import loss_parallel

    from ..models.reference import build_model, make_batch, torch_optimizer
    from .distributed import _unit_params
    from .tensor_run import DTensorTracker, parallelize
    from .tracker import training_loop

    setup = job.setup
    model = build_model(job.model_cfg, setup, seed=job.seed)
    parallelize(model, setup.tp, setup.sequence_parallel, mesh=mesh["tp"])
    release = apply_fsdp2(model, mesh["dp"], setup.reshard_after_forward)
    optimizer = torch_optimizer(mesh_optimizer_groups(model), setup, job.lr)
    batches = make_batch(job.model_cfg, setup, seed=job.seed + 1 + coords["dp"])  # the tp group's own data
    known = tuple(t for b in batches for t in b)
    tracker = DTensorTracker(model, optimizer, known=known, rank=rank)
    torch.manual_seed(job.seed)
    with tracker, loss_parallel():
        training_loop(tracker, model, optimizer, batches, setup.steps, setup.grad_accum, setup.set_to_none)
    details = {"engines": ["dtensor-tp", "fsdp2"], "dp_engine": "fsdp2",
               "reshard_after_forward": setup.reshard_after_forward, "root_reshard_after_forward": None,
               "fsdp_units": _unit_params(model), "backend_release": dataclasses.asdict(release),
               "placements": _placements(model)}
    return tracker.log, details


# -- TP x PP --------------------------------------------------------------------------------------------------

def _tp_stage_module_class():
    from .pipeline_run import StageModule

    class TPStageModule(StageModule):
        """pipeline_run's StageModule whose Llama blocks take the whole sequence length for their rotary
        tables and causal mask: with sequence parallelism a stage's input holds T / tp positions of the
        sequence (the reference LlamaModel takes T from the token ids), the attention all-gathers the rest."""

        def __init__(self, full, cfg, spec, seq_len: int) -> None:
            super().__init__(full, cfg, spec)
            self.seq_len = seq_len

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.gpt2:  # GPT-2's positions come from the token ids (first stage): the whole sequence
                return super().forward(x)
            m = self.model
            if self.first:
                x = m.embed_tokens(x)
            if self.n_blocks:
                T = self.seq_len
                pos = torch.arange(T, device=x.device, dtype=torch.float32)
                freqs = torch.outer(pos, m.inv_freq)
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if self.eager else None
                for layer in m.layers.values():
                    x = layer(x, cos, sin, causal)
            if self.last:
                x = m.norm(x)
            return self.lm_head(x) if self.last else x

    return TPStageModule


def parallelize_stage(module: nn.Module, plan: dict, tp_mesh, tp: int) -> nn.Module:
    """tensor_run's `parallelize` on one pipeline stage: the entries of the whole model's `tp_plan` that name
    a module of the stage (StageModule keeps the model's module names), attention on local heads. A stage
    holds the embedding or the head, never both once pp > 1: no tie to restore."""
    from torch.distributed.tensor.parallel import parallelize_module

    from .tensor_run import _gpt2_local_attention

    names = {n for n, _ in module.named_modules()}
    parallelize_module(module, tp_mesh, {k: v for k, v in plan.items() if k in names})
    gpt2 = hasattr(module, "transformer")
    blocks = module.transformer.h.values() if gpt2 else module.model.layers.values()
    for block in blocks:
        attn = block.attn if gpt2 else block.self_attn
        attn.n_head //= tp
        attn.n_kv //= tp
        if gpt2:
            attn.forward = types.MethodType(_gpt2_local_attention, attn)
    return module


def _tp_stage_shapes(cfg: TransformerConfig, setup: TrainingSetup, spec, dtype: torch.dtype):
    """pipeline_run's `_stage_shapes` on a tensor-parallel rank: the activations between stages are this rank's
    local tensors, (B, T / tp, D) with sequence parallelism; the last stage's output (not sent) is the
    vocabulary-sharded logits, given at their global shape."""
    B, T = setup.micro_batch, setup.seq_len
    t_local = T // setup.tp if setup.sequence_parallel else T
    hidden = torch.empty(B, t_local, cfg.d_model, dtype=dtype, requires_grad=True)
    x = torch.zeros(B, T, dtype=torch.long) if spec.first else hidden
    out = torch.empty(B, T, cfg.vocab_size, dtype=dtype, requires_grad=True) if spec.last else hidden
    return x, out


def _stage_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a stage module (ModuleDicts keyed by the blocks' indices)."""
    return list(module.transformer.h.values() if hasattr(module, "transformer") else module.model.layers.values())


def _measure_pipeline(rank: int, job: MeshJob, mesh, coords: dict):
    """TP x PP, FSDP2 x PP or FSDP2 x TP x PP as torchtitan builds them (torchtitan/models/llama3/infra/
    parallelize.py applied to each model part): each stage module tensor-parallelized on "tp", then
    `fully_shard` on its blocks and on the stage module itself with "dp" (the stage is the FSDP2 root that
    PipelineStage drives: no gradient sync before the last micro-batch's backward, then its post-backward)."""
    import gc

    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.tensor.parallel import loss_parallel

    from ..models.parallel.pipeline import rank_stages
    from ..models.reference import build_model, make_batch, torch_optimizer
    from .pipeline_run import SCHEDULES, _label_loss, _label_stage, pipeline_loss
    from .tensor_run import DTensorTracker, tp_plan

    cfg, setup = job.model_cfg, job.setup
    specs = rank_stages(setup, cfg.n_layer, coords["pp"])
    full = build_model(cfg, setup, seed=job.seed)
    dtype = next(full.parameters()).dtype
    plan = tp_plan(full, setup.sequence_parallel) if setup.tp > 1 else {}
    cls_stage = _tp_stage_module_class()
    modules = [cls_stage(full, cfg, spec, setup.seq_len).train() for spec in specs]
    del full
    gc.collect()
    release = None
    for module in modules:
        if setup.tp > 1:
            parallelize_stage(module, plan, mesh["tp"], setup.tp)
        if setup.dp > 1:  # the stage module is the root (fully_shard's default for a root: kept unsharded)
            release = apply_fsdp2(module, mesh["dp"], setup.reshard_after_forward, units=_stage_blocks(module),
                                  release=release)
    n_stages = setup.pp * setup.virtual_stages
    pp_group = mesh["pp"].get_group()
    stages = []
    for spec, module in zip(specs, modules):
        x, out = _tp_stage_shapes(cfg, setup, spec, dtype)
        stages.append(PipelineStage(module, spec.index, n_stages, torch.device("cpu"), input_args=(x,),
                                    output_args=(out,), group=pp_group))
        del x, out
    m = setup.grad_accum
    cls = getattr(schedules, SCHEDULES[setup.pp_schedule])
    schedule = cls(stages if setup.pp_schedule == "interleaved-1f1b" else stages[0], n_microbatches=m,
                   loss_fn=pipeline_loss)
    tracked = modules[0] if len(modules) == 1 else nn.ModuleDict({f"stage{s.index}": mod
                                                                  for s, mod in zip(specs, modules)})
    optimizer = torch_optimizer(mesh_optimizer_groups(tracked), setup, job.lr)
    batches = make_batch(cfg, setup, seed=job.seed + 1 + coords["dp"])
    whole = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    first, last = any(s.first for s in specs), any(s.last for s in specs)
    tracker = DTensorTracker(tracked, optimizer, known=whole + tuple(t for b in batches for t in b), rank=rank)
    step_now = [0]
    for stage in stages:
        _label_stage(stage, tracker, step_now)
    _label_loss(schedule, tracker, step_now)
    torch.manual_seed(job.seed)
    with tracker, (loss_parallel() if setup.tp > 1 else contextlib.nullcontext()):
        _pipeline_steps(tracker, schedule, optimizer, whole, first, last, setup, step_now)
    engines = ["pipeline"] + (["dtensor-tp"] if setup.tp > 1 else []) + (["fsdp2"] if setup.dp > 1 else [])
    fsdp = {}
    if setup.dp > 1:
        from .distributed import _unit_params
        fsdp = {"dp_engine": "fsdp2", "reshard_after_forward": setup.reshard_after_forward,
                "root_reshard_after_forward": None, "fsdp_units": _unit_params(tracked),
                "backend_release": dataclasses.asdict(release)}
    details = {"engines": engines, **fsdp, "pp_schedule": setup.pp_schedule,
               "virtual_stages": setup.virtual_stages,
               "stages": [{"index": s.index, "layers": [s.layers.start, s.layers.stop], "first": s.first,
                           "last": s.last} for s in specs],
               "loss_parallel": setup.tp > 1, "placements": _placements(tracked)}
    return tracker.log, details


def _pipeline_steps(tracker, schedule, optimizer, whole, first: bool, last: bool, setup: TrainingSetup,
                    step_now: list[int]) -> None:
    """pipeline_run's step loop (its `_measure_rank`): the whole batch built on the rank that reads it (INPUT),
    `schedule.step`, then the optimizer's step and zero_grad."""
    for step in range(1, setup.steps + 1):
        step_now[0] = step
        with tracker.phase(Phase.FORWARD, step, -1):
            x = whole[0].clone() if first else None
            y = whole[1].clone() if last else None
            if first:
                tracker.mark(x, Category.INPUT, name="batch.idx")
            if last:
                tracker.mark(y, Category.INPUT, name="batch.targets")
            args = (x,) if first else ()
            schedule.step(*args, target=y, return_outputs=False)
            tracker.scan()
            del x, y, args
        with tracker.phase(Phase.OPTIMIZER, step):
            optimizer.step()
            tracker.scan()
        with tracker.phase(Phase.ZERO_GRAD, step):
            optimizer.zero_grad(set_to_none=setup.set_to_none)
            tracker.scan()


__all__ = ["measure_mesh", "check_mesh", "mesh_sizes", "mesh_coords", "mesh_rank", "build_mesh", "apply_fsdp2",
           "mesh_optimizer_groups", "parallelize_stage", "MeshJob"]
