"""From model config + training setup to the op graph of a whole run: load, then `steps` x
(micro-batches of forward + backward, optimizer step, zero_grad).

The training loop described is the usual one:

    model = Model(cfg).to(device)               # load: parameters (+ fp32 master weights, main grads)
    for step in range(1, steps + 1):
        for mb in range(grad_accum):
            loss = model(batch[mb]); loss.backward()
        optimizer.step()                        # states created here at step 1
        optimizer.zero_grad(set_to_none=...)

With data parallelism, the engine of `setup.data_parallel.engine` (models/parallel/) decides each rank's layout,
its gathers and reduce buckets; `describe` writes one representative rank per class of identical ranks.
With `setup.offload.mode` the optimizer is wrapped (models/optimizers.py, models/offload.py): its
states live on the host between steps and `step()` runs chunk by chunk, each chunk copied in and out.

Steps repeat. Only a few things in a step's ops depend on its number (`step_kind`): the first step
(torch creates the optimizer states lazily, an offload's first step, DeepSpeed ZeRO-3 records the trace it
prefetches by from step 2 on) and the checkpoint saves (every `checkpoint_every` steps; the first async
save allocates the stager's cache). Once every one-off step has passed, the steps repeat with the period
of the saves, exactly: same ops, same blocks, same durations, each period later by the same time. So
`describe` writes only the steps `step_plan` says are distinct, with what surrounds them (`StepPlan`),
and the analysis reports the whole run from them: the peaks of a run whose later steps repeat earlier
ones were reached in those earlier ones (ties go to the first moment), and a repeated step's times are
its source's shifted by whole periods. 20000 steps cost what 4 do.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace
from math import prod

from ..simulator.events import Category, Phase
from ..simulator.gcpause import gc_paused
from ..simulator.ops import OpGraph
from ..simulator.run_metadata import RunMetadata
from . import families, float8
from .builder import GraphBuilder, trainable_params
from .checkpoint_io import load_checkpoint, rank_signatures, save_checkpoint, saves_after, signature_ranks
from .compile import compiled_tape
from .config import INT64_MAX, ConfigError, MLPConfig, TrainingSetup, TransformerConfig, dtype_bytes
from .devices import DeviceProfile, device_profile
from .families import family_of
from .moe import active_params
from .offload import OffloadedStates
from .offload_libraries import TorchaoCpuOffload
from .optimizer_step import InBackward, clip_grad_norm, create_states, optimizer_step
from .optimizers import OPTIMIZERS
from .parallel.checks import check_model_parallel
from .parallel.expert import expert_metadata
from .parallel.mesh import MeshTapes, is_model_parallel, mesh_classes, rank_builder, simulated_ranks
from .parallel.pipeline import pipeline_metadata, pipeline_timing
from .rank_ranges import RankRanges
from .replay import GradState, MicroBatchReplay
from .rl import GrpoRun
from .tape import Tape
from .traced.model import TracedModel

ModelConfig = TransformerConfig | MLPConfig | TracedModel
_new = object.__new__
TRACED_ON_CPU = ("traced on fake CPU tensors as torch dispatches for CUDA tensors (models/traced/cuda_program.py): "
                 "CUDA's autocast op lists, the SDPA kernel torch picks on this GPU, the fused dropout")


def build_tape(model: ModelConfig, setup: TrainingSetup, cpu: bool = False, ep_rank: int = 0,
               cuda: tuple[tuple[int, int], str] | None = None) -> Tape:
    """The forward tape of `model` under `setup`; with expert parallelism, expert-parallel rank `ep_rank`'s. A
    traced model on a GPU is recorded as the CUDA program of `cuda` = (compute capability, torch version)."""
    family = family_of(model)  # models/families/
    check_model_parallel(family, model, setup)  # tp / pp / cp / ep against the model (models/parallel/checks.py)
    if setup.compile.on:  # the compiled program of a traced model (models/compile)
        return compiled_tape(model, setup, cpu, cuda)
    family.check(model, setup)
    if setup.loop.chunked_loss and family is not families.nanogpt.FAMILY:  # models/transformer/chunked_loss.py
        raise ConfigError("chunked_loss", f"torchtune's chunked loss is modelled on the hand-written GPT / Llama "
                                          f"describer only, not the {family.name} family: use chunked_loss 0")
    tape = family.tape(model, setup, cpu, ep_rank, cuda)
    if family.hand_written and setup.batch.passes == "forward":
        # `out = model(batch)`: the hand-written tapes' loss ops (named loss.*) never run (a trace records none)
        tape = replace(tape, ops=[op for op in tape.ops if not op.name.startswith("loss.")])
    return tape


# -- which steps are described ---------------------------------------------------------------------------

def step_kind(setup: TrainingSetup, step: int) -> tuple[bool, bool, bool]:
    """Everything in the ops of optimizer step `step` that depends on its number (every place the describers
    read it): (the first step: lazy state init, the offload's first step, ZeRO-3's trace recording, models/
    parallel.py; a checkpoint save after it, models/checkpoint_io.saves_after; the first async save, which
    allocates the stager's cache for good). Two steps of one kind that follow steps of one kind are the same
    ops, once every one-off step has passed. A describer that makes a step depend on its number adds it here."""
    first_async_save = setup.checkpoint_io.save_mode == "async" and step == setup.checkpoint_io.every
    return (step == 1, saves_after(setup, step), first_async_save)


@dataclass(frozen=True)
class StepPlan:
    """Which of the `steps` requested steps are described and simulated (1..`simulated`), and what the
    others are: every step after `simulated` repeats the simulated step `source(step)`, one of the last
    `period` simulated steps, taken in turn, each period later by the same time. `simulated == steps`: none
    repeats (a full run). Kept in the graph's and the log's metadata (`steps`, `steps_simulated`,
    `repeat_period`)."""

    steps: int
    simulated: int
    period: int = 1

    @property
    def truncated(self) -> bool:
        return self.simulated < self.steps

    @property
    def repeated(self) -> tuple[int, int]:
        """The simulated steps that later steps repeat, first and last."""
        return self.simulated - self.period + 1, self.simulated

    def source(self, step: int) -> int:
        """The simulated step whose events `step` repeats (itself when it is simulated)."""
        if step <= self.simulated:
            return step
        first = self.repeated[0]
        return first + (step - first) % self.period

    def end_time(self, ends: dict[int, float]) -> float:
        """The end of the whole run on one rank, given when each simulated step ends there (`ends`: step ->
        its last moment, step 0 the load; ranks do not wait for each other, each repeats at its own pace):
        a repeated step ends when its source does, plus what one period takes (step
        `simulated`'s end less the end of the step one period before it) for each period between them.
        Exact up to the float rounding of those sums (a full run adds step durations one by one)."""
        end = max(ends.values(), default=0.0)
        if not self.truncated:
            return end
        k, p = self.simulated, self.period
        per_period = ends[k] - ends[k - p]
        last = range(max(k + 1, self.steps - p + 1), self.steps + 1)  # earlier steps end before these
        return max([end] + [ends[self.source(s)] + (s - self.source(s)) // p * per_period for s in last])

    def metadata(self) -> dict:
        """The plan's fields of a `RunMetadata`."""
        return {"steps": self.steps, "steps_simulated": self.simulated, "repeat_period": self.period}

    def summary(self) -> str:
        """"steps 1-4 simulated; steps 5-20000 repeat step 4's events" ("" for a full run)."""
        if not self.truncated:
            return ""
        first, last = self.repeated
        n, k = self.steps, self.simulated
        later = f"steps {k + 1}-{n} repeat" if n > k + 1 else f"step {n} repeats"
        if self.period == 1:
            return f"steps 1-{k} simulated; {later} step {last}'s events"
        return (f"steps 1-{k} simulated; {later} the events of steps {first}-{last} in turn: step s as step "
                f"{first} + (s - {first}) mod {self.period}")

    @classmethod
    def of(cls, metadata: RunMetadata) -> "StepPlan":
        """The plan a graph's or log's metadata records. A log without one (measured) is a full run, and so is
        a log whose run stopped at an OOM: it ends where a simulation of every step would have stopped."""
        steps = metadata.steps or (metadata.setup.batch.steps if metadata.setup is not None else None) or 1
        if metadata.stopped_at_oom:
            return cls(steps, steps)
        simulated, period = metadata.steps_simulated, metadata.repeat_period
        return cls(steps, steps if simulated is None else simulated, 1 if period is None else period)


def step_plan(setup: TrainingSetup) -> StepPlan:
    """How many of `setup.batch.steps` steps to simulate so that every distinct step is there, with the step
    before and after it, and the repeating tail once in full.

    The period is the save interval (1 without saves in the run). `step_kind` reads the step number only
    through step == 1, step == checkpoint_every and step % checkpoint_every, so past step period + 1 a step
    has the kind of the step one period later; the last step u that does not (step 1, or an async run's
    first save) is the last one-off. Then steps u + 2 .. u + 1 + period each follow a step of the kind
    every later step of their turn follows: one full period of the steady run. One more step, u + 2 +
    period (a repeat of step u + 2), is simulated after it, so the period's last step overlaps the next
    step's ops as in the full run (collectives and host copies can run across the step boundary):
        simulated = min(steps, u + 2 + period)
    4 steps without checkpoint saves, 3 + N with a save every N steps, 2N + 2 with async saves."""
    n, every = setup.batch.steps, setup.checkpoint_io.every
    period = every if 0 < every <= n else 1
    horizon = min(n - period, period + 1)  # compare steps of the run only
    last_once = max([1] + [t for t in range(1, horizon + 1)
                           if step_kind(setup, t) != step_kind(setup, t + period)])
    return StepPlan(steps=n, simulated=min(n, last_once + 2 + period), period=period)


# -- the graph ---------------------------------------------------------------------------------------------

def _check_tensor_sizes(tape: Tape) -> None:
    """Every tensor of the tape is one torch can make: its bytes, a product of sizes each within int64, within
    int64 too (a micro-batch of 2^62 passes every field's own check and makes logits no index can address)."""
    tensors = [(s.name, s.shape, s.dtype) for s in list(tape.inputs) + list(tape.buffers)]
    tensors += [(o.name, o.shape, o.dtype) for op in tape.ops for o in op.outputs]
    for name, shape, dtype in tensors:
        nbytes = prod(shape) * dtype_bytes(dtype)
        if nbytes > INT64_MAX:
            raise ConfigError("scenario", f"tensor {name} ({dtype}, shape {list(shape)}) would be {nbytes:,} bytes, "
                                          "over torch's int64 limit; lower the sizes that make it (micro_batch, "
                                          "seq_len, vocab_size, d_model, ...)")
    for p in tape.params:
        if p.numel * 4 > INT64_MAX:
            raise ConfigError("scenario", f"parameter {p.name} would hold {p.numel:,} elements, over torch's int64 "
                                          "limit in bytes; lower the sizes that make it")


@gc_paused  # hundreds of thousands of blocks and ops, no cycles (simulator/gcpause.py)
def describe(model: ModelConfig, setup: TrainingSetup, device: str | DeviceProfile = "H100-80GB",
             ranks: list[int] | None = None, all_steps: bool = False, torch_version: str = "2.6") -> OpGraph:
    """The op graph of `setup.batch.steps` training steps of `model`: the steps `step_plan(setup)` simulates
    (metadata `steps_simulated`; later steps repeat them, see `StepPlan`), or every step (`all_steps`).

    With data parallelism each rank is described by its engine (models/parallel/) into the same graph.
    `ranks=None` describes one representative of each class of ranks whose layouts are identical (one
    rank when they are symmetric, its lowest rank); the classes are in the metadata, keyed by that rank
    (a string):
      `rank_class_ranges`  every class's ranks as inclusive [first, last] ranges, ascending
                           ({"0": [[0, 1016], [1018, 1023]], "1017": [[1017, 1017]]}): any world size;
      `rank_classes`       every class's ranks listed ({"0": [0, 1, ...]}), or null for a class of more than
                           RANK_LIST_LIMIT (65,536) ranks, whose list would outweigh the rest of the run.
    On a GPU profile a traced model is the CUDA program of `torch_version`'s kernel rules (models/traced)."""
    profile = device if isinstance(device, DeviceProfile) else device_profile(device)
    plan = StepPlan(setup.batch.steps, setup.batch.steps) if all_steps else step_plan(setup)
    cuda = (profile.compute_capability, torch_version) if profile.is_cuda else None
    if setup.mesh.cp > 1 and not profile.is_cpu:  # (first: whatever else the setup has, no GPU profile runs cp yet)
        raise ConfigError("device", "context parallelism is simulated on the cpu profile for now (torch's ring "
                                    "attention around the CPU SDPA kernel, measured); GPU kernels' rings are not "
                                    "simulated yet; allowed: cpu")
    fp8_refused = float8.check_device(setup.float8.recipe, profile.is_cpu, profile.compute_capability, profile.name)
    if fp8_refused:
        raise ConfigError("fp8", fp8_refused)
    tape = build_tape(model, setup, profile.is_cpu, cuda=cuda)
    if setup.float8.recipe != "none" and tape.describer != "hand-written":
        raise ConfigError("fp8", f"float8 training is modelled in the hand-written describers (--preset, --hf-config "
                                 f"of llama / gpt2 configs), not the {tape.describer.split(' ')[0]} one; allowed "
                                 "with it: --describer hand-written")
    _check_tensor_sizes(tape)
    graph, ids = OpGraph(), itertools.count(1)
    graph.metadata = RunMetadata(torch_version=torch_version)  # read by the builders (GraphBuilder); replaced below
    model_parallel = is_model_parallel(setup)
    tapes = MeshTapes(tape, setup, lambda ep_rank: build_tape(model, setup, profile.is_cpu, ep_rank, cuda)) \
        if model_parallel else None
    if ranks is None and model_parallel:  # classes on the mesh: tp class x pipeline stage x dp class
        classes = mesh_classes(tapes, profile, engine_classes)
    elif ranks is None:
        classes = rank_classes(tape, setup, profile)
    else:
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < setup.mesh.world_size)]
        if bad:
            raise ConfigError("ranks", f"rank {bad[0]!r} is not in 0..{setup.mesh.world_size - 1}")
        classes = {r: RankRanges([(r, r + 1)]) for r in ranks}
    builders = []
    for rank in simulated_ranks(classes, setup) if model_parallel else classes:
        builder = (rank_builder(tape, setup, profile, rank, graph, ids, tapes) if model_parallel
             else GraphBuilder(tape, setup, profile, rank, graph, ids))
        rl = GrpoRun(model, builder, profile.context_bytes) if setup.rl.on else None
        _describe_rank(builder, plan.simulated, rl)
        builders.append(builder)
    if plan.truncated:
        check_repeats(graph, plan)
    family = family_of(model)
    graph.metadata = RunMetadata(
        model=model.name, setup=setup, device=profile.name, **plan.metadata(),
        describer=tape.describer, batch=family.batch_note(model, setup),
        describer_note=None if not tape.backward or profile.is_cpu else TRACED_ON_CPU,
        counted_flops_per_step=(tape.forward_flops() + sum(n.flops for n in tape.backward)) * setup.batch.grad_accum
        if tape.backward else None,
        n_params=tape.n_params, n_trainable=sum(builder.param_numel[p] for p in builder.trainable),
        forward_flops_per_microbatch=tape.forward_flops(),
        effective_batch=setup.effective_batch,
        tokens_per_step=setup.effective_batch * setup.batch.seq_len,
        rank_classes={str(r): list(members) if len(members) <= RANK_LIST_LIMIT else None
                      for r, members in classes.items()},
        rank_class_ranges={str(r): members.as_json() for r, members in classes.items()},
        assumptions=profile.assumptions(),
    )
    if setup.mesh.pp > 1 or setup.mesh.tp > 1 or setup.mesh.ep > 1:  # a rank holds a part: count the whole model's
        trainable = trainable_params(tape, setup.optimizer.frozen) - set(tape.gradless)
        experts = getattr(tape, "local_params", ())  # an expert-parallel rank's experts: 1 / ep of them
        graph.metadata = graph.metadata.updated(n_trainable=sum(p.numel * (setup.mesh.ep if p.name in experts else 1)
                                                                for p in tape.params if p.name in trainable))
    if setup.mesh.pp > 1:
        graph.metadata = graph.metadata.updated(pipeline={**pipeline_metadata(tape, setup),
                                                          "timing": pipeline_timing(graph)})
    if setup.mesh.ep > 1:
        graph.metadata = graph.metadata.updated(
            expert_parallel=expert_metadata(tapes.ep_tape, classes, setup, model.num_experts_per_tok))
    if family.experts:  # 6ND counts what one token runs through: top-k of the experts (models/moe.py)
        graph.metadata = graph.metadata.updated(
            n_active_params=active_params(model, tape.n_params),
            experts=f"top-{model.num_experts_per_tok} of {model.num_local_experts} experts")
    for b in builders:
        b.close()  # (no reference cycle keeps the graph alive once the caller drops it)
    return graph


RANK_LIST_LIMIT = 65_536  # the metadata's rank_classes lists a class's ranks up to this many (rank_class_ranges always)


def rank_classes(tape: Tape, setup: TrainingSetup, profile: DeviceProfile) -> dict[int, RankRanges]:
    """Ranks grouped by identical layout (bytes of every parameter shard and optimizer tensor, and what
    each saves): each class is simulated once, by its lowest rank; classes in the order of their lowest rank.

    Two ranks are in one class when their engines' `signature()` and their checkpoints' `rank_signature` are
    equal. Neither is asked rank by rank: the engine gives its signatures by ranges of ranks
    (`Engine.rank_segments`, from its layout functions: one range when symmetric, a few per distinct dim 0
    for FSDP2, one per owning rank and one for the rest for ZeroRedundancyOptimizer), the checkpoint the
    ranks where what a rank saves can change (`signature_ranks`: rank 1, a sharded save's writers). Cut at
    all of them, the ranks fall into ranges of equal signatures; a range whose engine signature no other
    range has is a class of its own, and the others are told apart by `rank_signatures` of their first
    ranks. O(ranges x parameters), whatever the world size."""
    n = setup.mesh.world_size
    first = GraphBuilder(tape, setup, profile, 0)
    segments = first.engine.rank_segments()
    starts = sorted({start for start, _ in segments} | signature_ranks(first))
    sigs, j = [], 0
    for start in starts:
        while j + 1 < len(segments) and segments[j + 1][0] <= start:
            j += 1
        sigs.append(segments[j][1])
    counts = Counter(sigs)
    saved = rank_signatures(first, [s for s, sig in zip(starts, sigs) if counts[sig] > 1],
                            lambda r: GraphBuilder(tape, setup, profile, r))
    classes: dict[tuple, list[tuple[int, int]]] = {}
    for k, (start, sig) in enumerate(zip(starts, sigs)):
        stop = starts[k + 1] if k + 1 < len(starts) else n
        classes.setdefault((sig, saved[start]) if start in saved else (sig,), []).append((start, stop))
    first.close()
    return {ranges[0][0]: RankRanges(ranges) for ranges in classes.values()}


def engine_classes(builder: GraphBuilder) -> dict[tuple, list[tuple[int, int]]]:
    """The data-parallel ranks of `builder`'s group by the engine's signature: {signature: [(start, stop), ...]}."""
    segments = builder.engine.rank_segments()
    out: dict[tuple, list[tuple[int, int]]] = {}
    for k, (start, sig) in enumerate(segments):
        out.setdefault(sig, []).append((start, segments[k + 1][0] if k + 1 < len(segments) else builder.engine.n))
    return out


def check_repeats(graph: OpGraph, plan: StepPlan) -> None:
    """Raise if the graph's last simulated step is not the step one period before it, op for op (streams,
    phases, durations, the bytes and kinds of the blocks allocated, how many freed; not the names, which
    may count buckets over the run), or if a step frees a block an earlier step allocated (a truncated
    run would keep it): `step_kind` misses something a describer reads."""
    k, p = plan.simulated, plan.period
    born: dict[int, int] = {}
    ops: dict[tuple[int, int], list] = {}
    for op in graph.ops_in_order():
        for blk in op.allocs:
            born[blk.id] = op.step
        if any(0 < born[f] < op.step for f in op.frees):
            raise RuntimeError(f"{op.name} (step {op.step}) frees a block an earlier step allocated: the steps "
                               "do not repeat; simulate every step")
        if op.step in (k - p, k):
            ops.setdefault((op.rank, op.step), []).append(
                (op.stream, op.phase, op.micro_batch_index, op.duration, op.flops, op.recompute, len(op.frees),
                 tuple((x.nbytes, x.category, x.pool, x.state, x.shard_factor) for x in op.allocs
                       if x.category is not Category.WORKSPACE)))  # a workspace is created once, at its first GEMM
    for rank in sorted({r for r, _ in ops}):
        if ops.get((rank, k)) != ops.get((rank, k - p)):
            raise RuntimeError(f"rank {rank}: step {k} does not repeat step {k - p}; models/training.step_kind "
                               "misses a step-dependent behaviour")


def _describe_rank(builder: GraphBuilder, steps: int, rl: GrpoRun | None = None) -> None:
    """Load, then optimizer steps 1..`steps` of rank `builder.rank`; with `rl`, each step's rollout first
    (models/rl.py)."""
    setup = builder.setup
    grads = GradState(persistent=setup.precision.fp32_grads)
    builder.engine.load(grads)
    states_loaded = load_checkpoint(builder)
    offload = None
    if setup.offload.mode == "cpu":  # torchao's CPUOffloadOptimizer (models/offload_libraries.py)
        offload = builder.cpu_offload = TorchaoCpuOffload(builder, builder.engine.optim_tensors())
        offload.load()
    elif setup.offload.mode != "none":
        offload = OffloadedStates(builder, builder.engine.optim_tensors())
    if not OPTIMIZERS[setup.optimizer.name].lazy and not states_loaded:  # made by the optimizer's constructor (Adagrad)
        for k, group in enumerate(builder.engine.optim_groups()):
            create_states(builder, 0, group, "optimizer.__init__" + (f".group{k}" if k else ""), Phase.LOAD)
        states_loaded = True
    if setup.optimizer.in_backward:  # each parameter stepped by its hook in backward (optimizer_step.InBackward)
        grads.in_backward = InBackward(builder, states_loaded)
        builder.replay_templates = None  # step 1's backward makes the states, step 2's the same start does not
    if rl is not None:
        rl.load()
    for step in range(1, steps + 1):
        if rl is not None:
            rl.rollout(step)
        if setup.mesh.pp > 1:  # the micro-batches in the pipeline schedule's order (models/parallel/pipeline.py)
            builder.engine.run_step(step, grads)
        for mb in range(setup.batch.grad_accum if setup.mesh.pp == 1 else 0):
            MicroBatchReplay(builder, builder.tape, step, mb, grads).run()
            if setup.batch.passes == "forward":
                break
            builder.engine.end_backward(step, mb)
        if setup.batch.passes == "forward":
            continue  # no loss, backward or optimizer step (models/config.py PASSES)
        if setup.optimizer.in_backward:  # torchtune's recipe calls no optimizer step(): the hooks ran them
            builder.op("optimizer.in_backward", Phase.OPTIMIZER, step, -1, [], [])
        else:
            if setup.loop.clips_gradients:
                clip_grad_norm(builder, step)
            optimizer_step(builder, step, grads, states_loaded, offload)
        builder.op("zero_grad", Phase.ZERO_GRAD, step, -1, [], builder.engine.zero_grad_frees(grads))
        if saves_after(setup, step):
            save_checkpoint(builder, step)
