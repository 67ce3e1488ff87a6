"""Pipeline parallelism (`TrainingSetup.pp`): the model's layers split into stages, one pipeline rank each
(`virtual_stages` each when interleaved), and the schedule of forward / backward micro-batch actions per rank,
simulated as torch.distributed.pipelining (torch 2.13) runs it.

Stage layout (`stage_layout`): torchtitan's `generate_llm_fqn_per_model_part` (torchtitan/distributed/
pipeline_parallel.py) with its default weights: the embeddings and the output (final norm + head, and the loss)
each count as one layer; the n_layer + 2 "effective layers" are spread as evenly as possible over the
pp x virtual_stages stages, the first `extra` stages taking one more; the first stage holds the embeddings and
(its share - 1) blocks, the last (its share - 1) blocks and the output, the others their share of blocks. More
stages than effective layers is refused (torchtitan raises too). Stage s runs on rank s % pp ("loop" style:
ScheduleInterleaved1F1B, `stage_index_to_group_rank`), or for zbv the V: rank r holds stages r and
2 x pp - 1 - r (`generate_stage_to_rank_mapping(style="v")`). Each stage is a deep copy of its modules
(torchtitan's `pipeline_module_split`): a tied embedding / head weight is two parameters, one on the first
stage, one (`lm_head.weight`) on the last. Parameters, gradients and optimizer states of a stage live on its
rank only; a model-level buffer (Llama's rotary `inv_freq`) is on every stage, a layer's on its stage.

Schedules (`rank_actions`), each derived from torch/distributed/pipelining/schedules.py:
- gpipe (`ScheduleGPipe._step_microbatches`): every forward, then every backward, in micro-batch order.
- 1f1b (`Schedule1F1B._step_microbatches`): min(m, pp - r) warm-up forwards, then backward / forward pairs
  (1B1F) while forwards remain, then the remaining backwards: in compute order F0 .. F(pp-r-1), B0, F(pp-r),
  B1, ..., the textbook pp - r - 1 warm-up forwards and steady 1F1B, as `_get_pipeline_order` writes it (its
  IR starts the last rank at F1, skipping F0: the runtime runs F0 first).
- interleaved-1f1b (`ScheduleInterleaved1F1B._calculate_single_rank_operations` + `_get_1f1b_rank_ops`):
  rounds = max(1, m // pp), mb_per_round = m // rounds; warm-up = min((v - 1) x mb_per_round + 2 x (pp - 1 - r),
  m x v) forwards, then forward / backward pairs, then backwards; the forward of step k runs local stage
  (k // mb_per_round) % v, the backward of step k local stage v - 1 - ((k - warm-up) // mb_per_round) % v.
- zbv (`ScheduleZBVZeroBubble._calculate_single_rank_operations`): the V with the backward split into
  input (I) and weight (W) gradients; its order is derived here, its memory is not simulated yet.

The tapes (`stage_tapes`, `rank_tape`): a hand-written GPT-2 / Llama tape cut into those stages; pipeline.py
replays them in each rank's schedule order.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace

from ..config import ConfigError, TrainingSetup
from ..tape import Tape, TensorSpec

# forward, full backward, backward for inputs, backward for weights (I: the schedule's own letter)
F, B, I, W = "F", "B", "I", "W"  # noqa: E741


# -- the layout ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the rank it runs on, the transformer blocks it holds (`layers`), and
    whether it holds the embeddings (`first`) or the output: final norm, head and loss (`last`)."""

    index: int
    rank: int
    layers: range
    first: bool
    last: bool


def stage_layers(n_stages: int, n_layer: int) -> list[range]:
    """The blocks of each stage: torchtitan's `generate_llm_fqn_per_model_part(n_stages, n_layer)` with
    input_weight = output_weight = 1."""
    if n_stages == 1:
        return [range(n_layer)]
    effective = n_layer + 2
    if n_stages > effective:
        raise ConfigError("pp", f"{n_stages} stages is more than n_layer + 2 = {effective} effective layers")
    per, extra = divmod(effective, n_stages)
    out, current = [], 0
    for s in range(n_stages):
        share = per + (1 if s < extra else 0)
        blocks = share - (1 if s in (0, n_stages - 1) else 0)
        out.append(range(current, min(current + blocks, n_layer)))
        current = out[-1].stop
    return out


def stage_rank(stage: int, pp: int, n_stages: int, style: str = "loop") -> int:
    """The pipeline rank of `stage`: loop style s % pp; V style (zbv) rank r holds r and n_stages - 1 - r."""
    if style == "v":
        return stage if stage < pp else n_stages - 1 - stage
    return stage % pp


def stage_layout(setup: TrainingSetup, n_layer: int) -> list[StageSpec]:
    n = setup.mesh.pp * setup.mesh.virtual_stages
    style = "v" if setup.mesh.pp_schedule == "zbv" else "loop"
    return [
        StageSpec(index=s, rank=stage_rank(s, setup.mesh.pp, n, style), layers=layers, first=s == 0, last=s == n - 1)
        for s, layers in enumerate(stage_layers(n, n_layer))
    ]


def rank_stages(setup: TrainingSetup, n_layer: int, rank: int) -> list[StageSpec]:
    """The stages of one pipeline rank, in the order the schedule's `stages` list gives them (ascending)."""
    return [st for st in stage_layout(setup, n_layer) if st.rank == rank]


# -- the schedules --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Action:
    """One compute action of a rank: `kind` F, B, I or W, on `stage` (its global index), micro-batch `mb`."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def rank_actions(schedule: str, pp: int, m: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """The compute actions of `rank`, in the order its schedule runs them (torch's idle slots dropped)."""
    if schedule == "gpipe":
        return [Action(F, rank, i) for i in range(m)] + [Action(B, rank, i) for i in range(m)]
    if schedule == "1f1b":
        return _one_f_one_b(pp, m, rank)
    if schedule == "interleaved-1f1b":
        return _interleaved(pp, m, rank, virtual_stages)
    if schedule == "zbv":
        return _zbv(pp, m, rank)
    raise ValueError(f"unknown schedule {schedule!r}")


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """Schedule1F1B._step_microbatches: warm-up forwards, 1B1F, cool-down backwards."""
    warmup = min(m, pp - rank)
    out = [Action(F, rank, i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        out.append(Action(B, rank, bwd))
        bwd += 1
        if fwd == m:
            break
        out.append(Action(F, rank, fwd))
        fwd += 1
    out += [Action(B, rank, i) for i in range(bwd, m)]
    return out


def _interleaved(pp: int, m: int, rank: int, v: int) -> list[Action]:
    """ScheduleInterleaved1F1B: `_get_warmup_ops` (multiply_factor 2) and `_get_1f1b_rank_ops`."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v
    steady = total - warmup

    def fwd_stage(k: int) -> int:
        return (k // per_round) % v * pp + rank

    def bwd_stage(k: int) -> int:
        return (v - 1 - ((k - warmup) // per_round) % v) * pp + rank

    fwd_mb: dict[int, int] = {}
    bwd_mb: dict[int, int] = {}

    def nxt(counter: dict[int, int], stage: int) -> int:
        counter[stage] = counter.get(stage, 0) + 1
        return counter[stage] - 1

    out = []
    for k in range(warmup + steady + warmup):  # warm-up, forward / backward pairs, cool-down (= warm-up long)
        if k < warmup + steady:
            st = fwd_stage(k)
            out.append(Action(F, st, nxt(fwd_mb, st)))
        if k >= warmup:
            st = bwd_stage(k)
            out.append(Action(B, st, nxt(bwd_mb, st)))
    return out


def _zbv(pp: int, m: int, rank: int) -> list[Action]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations: chunk 0 is stage r, chunk 1 stage
    2 pp - 1 - r; the order is built for max(2 pp - 1, m) micro-batches and the actions of micro-batches
    >= m dropped."""
    n = max(2 * pp - 1, m)
    s0, s1 = rank, 2 * pp - 1 - rank
    f0 = f1 = b0 = b1 = 0
    out: list[Action] = []
    for _ in range(2 * (pp - rank) - 1):
        out.append(Action(F, s0, f0))
        f0 += 1
    for _ in range(rank):
        out += [Action(F, s1, f1), Action(F, s0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - rank):
        out += [Action(F, s1, f1), Action(I, s1, b1), Action(W, s1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(Action(F, s0, f0))
            f0 += 1
        out += [Action(I, s0, b0), Action(W, s0, b0), Action(F, s1, f1), Action(I, s1, b1), Action(W, s1, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [Action(I, s0, b0), Action(I, s1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - rank):
        out += [Action(I, s0, b0), Action(W, s0, w0)]
        b0 += 1
        w0 += 1
    out += [Action(W, s1, k) for k in range(w1, b1)] + [Action(W, s0, k) for k in range(w0, b0)]
    return [a for a in out if a.mb < m]


# -- the tapes of a pipeline rank --------------------------------------------------------------------------

_LAYER = re.compile(r"^(?:transformer\.h|model\.layers)\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The transformer block an op or tensor name belongs to (transformer.h.<i>. / model.layers.<i>.), or None."""
    hit = _LAYER.match(name)
    return int(hit.group(1)) if hit else None


@dataclass
class StageTape:
    """One stage's share of the model's tape: its ops (in tape order), the tensor it receives (`input`: the
    residual stream entering its first block; None on the first stage), the tensor it sends (`output`: None on
    the last stage, whose output is the loss), the batch tensors it reads, and its parameters, named as its
    module names them (a tied head weight is the last stage's own `lm_head.weight`)."""

    spec: StageSpec
    tape: Tape
    input: TensorSpec | None
    output: TensorSpec | None
    batch: tuple[TensorSpec, ...]
    params: tuple[str, ...]


@dataclass
class RankTape(Tape):
    """The tape of one pipeline rank: the parameters and buffers of its stages (what it loads, steps and
    zeroes), and the stages themselves (`stages`, ascending), each replayed on its own."""

    stages: tuple[StageTape, ...] = ()
    full_params: int = 0  # the whole model's parameter count


def stage_tapes(tape: Tape, setup: TrainingSetup) -> list[StageTape]:
    """Cut a hand-written GPT-2 / Llama tape into the stages of `stage_layout`."""
    ops = tape.ops
    layer = [layer_of(op.name) for op in ops]
    n_layer = max((x for x in layer if x is not None), default=-1) + 1
    first_block = next(i for i, x in enumerate(layer) if x is not None)
    last_block = max(i for i, x in enumerate(layer) if x is not None)
    prologue, epilogue = range(0, first_block), range(last_block + 1, len(ops))
    produced = {o.name: i for i, op in enumerate(ops) for o in op.outputs}
    batch = {t.name: t for t in tape.inputs}
    batch_derived: set[str] = set(batch)
    for op in ops:
        if any(x in batch_derived for x in op.inputs):
            batch_derived.update(o.name for o in op.outputs)
    block_ends = {}  # layer -> the residual stream leaving it (its last op's output)
    for i, x in enumerate(layer):
        if x is not None and ops[i].outputs:  # (a scope end's release has none)
            block_ends[x] = ops[i].outputs[0]
    stream_in = [t for i in range(first_block, last_block + 1) if layer[i] == 0 for t in ops[i].inputs
                 if t in produced and produced[t] in prologue and t in batch_derived][0]
    specs = {o.name: o for op in ops for o in op.outputs}

    def stream_before(k: int) -> TensorSpec:  # the residual stream entering block k (k == n_layer: the output)
        return specs[stream_in] if k == 0 else block_ends[k - 1]

    uses = Counter(name for op in ops for name in op.params)
    tied = [p for p in tape.params if uses[p.name] > 1]
    out = []
    for spec in stage_layout(setup, n_layer):
        own = [i for i, x in enumerate(layer) if x is not None and x in spec.layers]
        if spec.last:
            own += list(epilogue)
        needed = {t for i in own for t in ops[i].inputs}
        output = None if spec.last else stream_before(spec.layers.stop)
        if output is not None:
            needed.add(output.name)
        chosen = set(own)
        for i in reversed(prologue):  # what of the prologue this stage computes itself
            makes = {o.name for o in ops[i].outputs} & needed
            if makes and (spec.first or not (makes & batch_derived)):
                chosen.add(i)
                needed |= set(ops[i].inputs)
        chosen_ops = [ops[i] for i in sorted(chosen)]
        inp = None if spec.first else stream_before(spec.layers.start)
        if spec.last and not spec.first:  # a tied weight (the embedding as head) is the last stage's own copy
            chosen_ops = [replace(op, params=tuple("lm_head.weight" if p in {t.name for t in tied} else p
                                                   for p in op.params))
                          if any(p in {t.name for t in tied} for p in op.params) and op.name == "lm_head" else op
                          for op in chosen_ops]
        used = {p for op in chosen_ops for p in op.params}
        params = [p.name for p in tape.params if p.name in used]
        if "lm_head.weight" in used and "lm_head.weight" not in params:
            params.append("lm_head.weight")
        made = {o.name for op in chosen_ops for o in op.outputs}
        reads = [batch[t] for t in dict.fromkeys(t for op in chosen_ops for t in op.inputs) if t in batch]
        held = tuple(h for h in tape.held if h in made) + ((output.name,) if output is not None else ()) + \
            ((tape.loss,) if tape.loss in made else ())
        head = [replace(t, name="lm_head.weight") for t in tied[:1]] if "lm_head.weight" in used else []
        stage = Tape(params=[p for p in tape.params if p.name in used] + head, ops=chosen_ops, inputs=[], buffers=[],
                     held=held, loss=tape.loss, describer=tape.describer, param_dtypes=tape.param_dtypes)
        out.append(StageTape(spec, stage, inp, output, tuple(reads), tuple(params)))
    return out


def rank_tape(tape: Tape, setup: TrainingSetup, rank: int, cut: list[StageTape] | None = None) -> RankTape:
    """The tape one pipeline rank loads and steps: its stages' parameters (the last stage's own head weight when
    the embedding is tied to it), the buffers of its blocks, and a copy of every model-level buffer per stage.
    `cut`: the tape's stages already cut (`stage_tapes(tape, setup)`), shared by the ranks of one pipeline."""
    stages = [st for st in (cut if cut is not None else stage_tapes(tape, setup)) if st.spec.rank == rank]
    by_name = {p.name: p for p in tape.params}
    head = next((p for p in tape.params if p.name.endswith("wte.weight") or p.name.endswith("embed_tokens.weight")),
                None)
    params, seen = [], set()
    for st in stages:
        for name in st.params:
            if name not in seen:
                seen.add(name)
                params.append(by_name[name] if name in by_name else replace(head, name=name))
    buffers = [t for st in stages for t in tape.buffers  # a model-level buffer: one copy per stage module
               if layer_of(t.name) is None or layer_of(t.name) in st.spec.layers]
    return RankTape(params=params, ops=[op for st in stages for op in st.tape.ops], inputs=[], buffers=buffers,
                    held=(), loss=tape.loss, describer=tape.describer, param_dtypes=tape.param_dtypes,
                    buffers_follow_params=tape.buffers_follow_params, stages=tuple(stages),
                    full_params=tape.n_params)
