"""Measure every rank of a real pipeline-parallel CPU run: torch.distributed.pipelining on gloo, 127.0.0.1.

`measure_pipeline` spawns `setup.mesh.pp` processes (one per pipeline rank) joined as every real run joins its ranks
(traces/harness.py `measure_ranks`: rendezvous on a TCPStore rank 0 binds to 127.0.0.1 at a free port, gloo on
`lo`). Each process
builds the same reference model (`traces.reference.build_model`, same seed), cuts its stages out of it as
torchtitan's `pipeline_module_split` does (`stage_modules`; the stage layout is models/parallel/stages.py
`stage_layout`: a stage keeps deep copies of its modules, so a tied embedding / head weight becomes one
parameter on the first stage and one on the last), wraps each in a `PipelineStage` with its input and output
shapes given (`build_pipeline`; static metadata: no shape-inference forward), and runs `setup.batch.steps` steps of
(`run_pipeline_steps`)

    schedule.step(x, target=y, return_outputs=False)   # torchtitan's call; x on the first stage, y on the last
    optimizer.step(); optimizer.zero_grad(set_to_none)

with the schedule of `setup.mesh.pp_schedule` (ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B over
`setup.batch.grad_accum` micro-batches of `setup.batch.micro_batch`, loss_fn = the reference model's own cross-entropy,
scale_grads=True: the gradients are divided in place by the micro-batch count after the last backward) under
the rank's own `AllocationTracker(rank=r)`. The whole batch (x: (m x B, T) token ids, y: targets) is built at
the start of each step on the rank that reads it, as INPUT; the schedule splits it into views. Each stage's
forward (and the last stage's loss) and backward of a micro-batch are labelled FORWARD / BACKWARD with that
micro-batch (`label_pipeline`: `label_stage`, `label_loss`); the schedule's own work between them (its
first-step buffers, sends, what it lets go of, the end of the step) is FORWARD with micro-batch -1, as the
simulation labels it (models/parallel/pipeline.py). traces/mesh_run.py runs the same pieces on the "pp"
sub-mesh of a device mesh, its stage modules tensor-parallelized and / or sharded by FSDP2 first.
"""

from __future__ import annotations

import copy
import functools
import gc

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, schedules

from ..models.config import TrainingSetup, TransformerConfig
from ..models.families import family_of
from ..models.parallel.checks import check_model_parallel
from ..models.parallel.stages import StageSpec, rank_stages
from ..simulator.events import Category, EventLog, Phase
from .harness import Job, batch_tensors, measure_ranks, run_metadata, tracking
from .reference import build_model, make_batch, optimizer_class, torch_optimizer
from .tracker import AllocationTracker

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}

PipelineJob = Job  # what every pipeline rank is sent: the harness's job (the setup says the pipeline)


def measure_pipeline(model_cfg: TransformerConfig, setup: TrainingSetup, *, seed: int = 0,
                     timeout_s: float = 120.0) -> list[EventLog]:
    """Run `setup.batch.steps` real pipeline-parallel training steps of `model_cfg` on `setup.mesh.pp` CPU processes
    (gloo, loopback only); one tracked `EventLog` per pipeline rank, in rank order. Uses micro_batch, seq_len,
    grad_accum (the micro-batches of a step), steps, precision ("fp32" or "bf16"), optimizer, optimizer_impl,
    set_to_none, pp, pp_schedule and virtual_stages. Call under `if __name__ == "__main__":` in a script;
    every process is joined within `timeout_s` seconds, else all are killed and TimeoutError is raised."""
    _check(model_cfg, setup)
    job = functools.partial(PipelineJob, model_cfg, setup, seed=seed, timeout_s=timeout_s)
    return measure_ranks(_measure_rank, job, setup.mesh.pp, f"{setup.mesh.pp_schedule} x {setup.mesh.pp} ranks",
                         prefix="peakledger-pp-")


def _check(model_cfg, setup: TrainingSetup) -> None:
    if setup.mesh.pp < 2:
        raise ValueError(f"a pipeline run needs pp >= 2, got {setup.mesh.pp}")
    if setup.mesh.pp_schedule not in SCHEDULES:
        raise NotImplementedError(f"real pipeline runs use {', '.join(SCHEDULES)}, not {setup.mesh.pp_schedule!r}")
    if not setup.precision.uniform:
        raise NotImplementedError(f"pipeline measurement runs fp32 or pure bf16, not {setup.precision.name!r}")
    check_model_parallel(family_of(model_cfg), model_cfg, setup)
    optimizer_class(setup)


# -- the stages ---------------------------------------------------------------------------------------------

class StageModule(nn.Module):
    """The modules of one stage, cut out of the reference `GPT` (traces/reference/nanogpt.py) with their names kept:
    GPT-2: `transformer.{wte, wpe, drop}` (first), `transformer.h.<i>` (as a ModuleDict keyed by the block's
    index), `transformer.ln_f` and `lm_head` (last); Llama: `model.embed_tokens` (first), `model.layers.<i>`,
    `model.norm` and `lm_head` (last), and the rotary `inv_freq` buffer on every stage. `forward` is the
    reference model's, restricted to the stage: GPT.forward and LlamaModel.forward (Llama's cos / sin tables
    computed on each stage that runs blocks, for the whole sequence of `seq_len` positions: under sequence
    parallelism a stage's input holds only this rank's T / tp positions, traces/mesh_run.py)."""

    def __init__(self, full: nn.Module, cfg: TransformerConfig, spec: StageSpec, seq_len: int) -> None:
        super().__init__()
        self.cfg, self.first, self.last, self.n_blocks = cfg, spec.first, spec.last, len(spec.layers)
        self.seq_len = seq_len
        self.gpt2 = cfg.architecture == "gpt2"
        if self.gpt2:
            parts = {}
            if spec.first:
                parts.update(wte=copy.deepcopy(full.transformer.wte), wpe=copy.deepcopy(full.transformer.wpe),
                             drop=copy.deepcopy(full.transformer.drop))
            parts["h"] = nn.ModuleDict({str(i): copy.deepcopy(full.transformer.h[i]) for i in spec.layers})
            if spec.last:
                parts["ln_f"] = copy.deepcopy(full.transformer.ln_f)
            self.transformer = nn.ModuleDict(parts)
        else:
            self.model = nn.Module()
            if spec.first:
                self.model.embed_tokens = copy.deepcopy(full.model.embed_tokens)
            self.model.layers = nn.ModuleDict({str(i): copy.deepcopy(full.model.layers[i]) for i in spec.layers})
            if spec.last:
                self.model.norm = copy.deepcopy(full.model.norm)
            self.model.register_buffer("inv_freq", full.model.inv_freq.clone(), persistent=False)
            self.eager = full.model.eager
        if spec.last:
            self.lm_head = copy.deepcopy(full.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gpt2:
            t = self.transformer
            if self.first:
                pos = torch.arange(0, x.size(1), dtype=torch.long, device=x.device)
                x = t.drop(t.wte(x) + t.wpe(pos))
            for block in t.h.values():
                x = block(x)
            if self.last:
                x = t.ln_f(x)
        else:
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


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference model's loss (GPT.forward): cross-entropy over the flattened logits."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _stage_shapes(cfg: TransformerConfig, setup: TrainingSetup, spec: StageSpec, dtype: torch.dtype,
                  local_seq_len: int | None = None):
    """Example input and output tensors of one stage's micro-batch (PipelineStage's static metadata). The
    activations between stages hold `local_seq_len` positions (None: setup.batch.seq_len; with sequence parallelism a
    tensor-parallel rank's T / tp); the token ids and the last stage's output (its logits, not sent) the whole
    sequence."""
    B, T = setup.batch.micro_batch, setup.batch.seq_len
    hidden = torch.empty(B, T if local_seq_len is None else local_seq_len, cfg.d_model, dtype=dtype,
                         requires_grad=True)
    x = torch.zeros(B, T, dtype=torch.long) if spec.first else hidden
    out = torch.empty(B, T, cfg.vocab_size, dtype=dtype, requires_grad=True) if spec.last else hidden
    return x, out


def stage_modules(cfg: TransformerConfig, setup: TrainingSetup, specs: list[StageSpec],
                  seed: int) -> tuple[list[StageModule], torch.dtype]:
    """The stage modules of `specs` (training mode) cut out of the reference model, built as every rank builds it
    (`seed`) and dropped again, and the dtype of its parameters."""

    full = build_model(cfg, setup, seed=seed)
    dtype = next(full.parameters()).dtype
    modules = [StageModule(full, cfg, spec, setup.batch.seq_len).train() for spec in specs]
    del full
    gc.collect()
    return modules, dtype


def build_pipeline(modules: list[nn.Module], specs: list[StageSpec], cfg: TransformerConfig,
                   setup: TrainingSetup, dtype: torch.dtype, *, group=None, local_seq_len: int | None = None):
    """Each stage module in a `PipelineStage` (static input / output shapes, `_stage_shapes`: no shape-inference
    forward) whose peers are the ranks of `group` (None: the default group), scheduled by `setup.mesh.pp_schedule`
    over `setup.batch.grad_accum` micro-batches with `pipeline_loss`. Returns (stages, schedule, the module the
    tracker names: the one stage module, or a ModuleDict of them keyed "stage<index>")."""
    n_stages = setup.mesh.pp * setup.mesh.virtual_stages
    stages = []
    for spec, module in zip(specs, modules):
        x, out = _stage_shapes(cfg, setup, spec, dtype, local_seq_len)
        stages.append(PipelineStage(module, spec.index, n_stages, torch.device("cpu"), input_args=(x,),
                                    output_args=(out,), group=group))
        del x, out
    cls = getattr(schedules, SCHEDULES[setup.mesh.pp_schedule])
    schedule = cls(
        stages if setup.mesh.pp_schedule == "interleaved-1f1b" else stages[0],
        n_microbatches=setup.batch.grad_accum,
        loss_fn=pipeline_loss,
    )
    tracked = modules[0] if len(modules) == 1 else nn.ModuleDict({f"stage{s.index}": mod
                                                                  for s, mod in zip(specs, modules)})
    return stages, schedule, tracked


def stage_records(specs: list[StageSpec]) -> list[dict]:
    """The rank's stages as its metadata records them."""
    return [{"index": s.index, "layers": [s.layers.start, s.layers.stop], "first": s.first, "last": s.last}
            for s in specs]


def _measure_rank(rank: int, job: PipelineJob) -> EventLog:
    """One pipeline rank's run (traces/harness.py `measure_ranks` runs it in a spawned process, in the group)."""
    cfg, setup = job.model_cfg, job.setup
    specs = rank_stages(setup, cfg.n_layer, rank)
    modules, dtype = stage_modules(cfg, setup, specs, job.seed)
    stages, schedule, tracked = build_pipeline(modules, specs, cfg, setup, dtype)
    optimizer = torch_optimizer([p for mod in modules for p in mod.parameters()], setup, job.lr)
    batches = make_batch(cfg, setup, seed=job.seed + 1)  # the m micro-batches of a step, the same every step
    tracker = train_pipeline(AllocationTracker, stages, schedule, tracked, optimizer, specs, batches, setup,
                             rank=rank, seed=job.seed)
    return tracker.log(
        run_metadata(rank, setup.mesh.pp, cfg, setup).updated(
            engine="pipeline",
            pp=setup.mesh.pp,
            pp_schedule=setup.mesh.pp_schedule,
            virtual_stages=setup.mesh.virtual_stages,
            stages=stage_records(specs),
            model_kind=type(cfg).__name__,
        )
    )


def train_pipeline(tracker_class, stages, schedule, tracked: nn.Module, optimizer, specs: list[StageSpec], batches,
                   setup: TrainingSetup, *, rank: int, seed: int, contexts=()):
    """`setup.batch.steps` steps of a rank's pipeline (`run_pipeline_steps`, the stages and the schedule labelled by
    `label_pipeline`) under a new `tracker_class` (AllocationTracker; a mesh run's DTensorTracker) of `tracked` and
    `optimizer` for `rank`, told of the step's whole batch (the micro-batches of `batches` concatenated) and of
    the micro-batches, entered after seeding torch's RNG with `seed`, then `contexts` (a mesh run's
    `loss_parallel()`). Returns the tracker, whose log the caller writes."""
    whole = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    tracker = tracker_class(tracked, optimizer, known=whole + batch_tensors(batches), rank=rank)
    step_now = label_pipeline(stages, schedule, tracker)
    with tracking(tracker, seed, *contexts):
        run_pipeline_steps(tracker, schedule, optimizer, whole, any(s.first for s in specs),
                           any(s.last for s in specs), setup, step_now)
    return tracker


def run_pipeline_steps(tracker, schedule, optimizer, whole: tuple[torch.Tensor, torch.Tensor], first: bool,
                       last: bool, setup: TrainingSetup, step_now: list[int]) -> None:
    """`setup.batch.steps` steps under `tracker` (already entered): the whole batch `whole` (x, y) cloned on the rank
    that reads it (x on the `first` stage's rank, y on the `last` one's) and marked INPUT, `schedule.step`, all
    FORWARD with micro-batch -1 (the stages' own work relabelled by `label_pipeline`, whose `step_now` is kept
    at the current step); then OPTIMIZER (optimizer.step()) and ZERO_GRAD (zero_grad(setup.optimizer.set_to_none))."""
    for step in range(1, setup.batch.steps + 1):
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
            optimizer.zero_grad(set_to_none=setup.optimizer.set_to_none)
            tracker.scan()


def label_pipeline(stages, schedule, tracker) -> list[int]:
    """`label_stage` on each of `stages` and `label_loss` on `schedule`; returns the one-element list holding the
    current step that they read (`run_pipeline_steps` sets it)."""
    step_now = [0]
    for stage in stages:
        label_stage(stage, tracker, step_now)
    label_loss(schedule, tracker, step_now)
    return step_now


def label_loss(schedule, tracker, step_now: list[int]) -> None:
    """The last stage's loss of a micro-batch (the schedule's `_maybe_compute_loss`, right after the stage's
    forward) is labelled FORWARD with that micro-batch, as the stage's forward is."""
    compute = schedule._maybe_compute_loss

    def maybe_compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs):
        with tracker.phase(Phase.FORWARD, step_now[0], mb_index):
            return compute(stage, output, target_mbs, mb_index, *args, **kwargs)

    schedule._maybe_compute_loss = maybe_compute_loss


def label_stage(stage, tracker, step_now: list[int]) -> None:
    """Run each forward / backward of `stage` under its own phase and micro-batch, mark what the stage keeps
    of a forward (its output, held for the backward) as ACTIVATION, and label gradients after a backward."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        with tracker.phase(Phase.FORWARD, step_now[0], fwd_chunk_id):
            out = forward(fwd_chunk_id, *args, **kwargs)
            tracker.mark(out, Category.ACTIVATION)
        return out

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        with tracker.phase(Phase.BACKWARD, step_now[0], bwd_chunk_id):
            result = backward(bwd_chunk_id, *args, **kwargs)
            tracker.scan()
        return result

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk


__all__ = ["measure_pipeline", "StageModule", "pipeline_loss", "stage_modules", "build_pipeline", "stage_records",
           "run_pipeline_steps", "train_pipeline", "label_pipeline", "label_stage", "label_loss", "PipelineJob",
           "SCHEDULES"]
