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
  B1, ..., the textbook pp - r - 1 warm-up forwards and steady 1F1B (`_get_pipeline_order` writes it so).
- interleaved-1f1b (`ScheduleInterleaved1F1B._calculate_single_rank_operations` + `_get_1f1b_rank_ops`):
  rounds = max(1, m // pp), mb_per_round = m // rounds; warm-up = min((v - 1) x mb_per_round + 2 x (pp - 1 - r),
  m x v) forwards, then forward / backward pairs, then backwards; the forward of step k runs local stage
  (k // mb_per_round) % v, the backward of step k local stage v - 1 - ((k - warm-up) // mb_per_round) % v.
- zbv (`ScheduleZBVZeroBubble._calculate_single_rank_operations`): the V with the backward split into
  input (I) and weight (W) gradients; its order is derived here, its memory is not simulated yet.

The step (`PipelineRank`) as `PipelineStage` and the schedules allocate and free: see that class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..config import ConfigError, MLPConfig, TrainingSetup, TransformerConfig

F, B, I, W = "F", "B", "I", "W"  # forward, full backward, backward for inputs, backward for weights
SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


# -- what is checked against the model -----------------------------------------------------------------------

def check_model_parallel(model, setup: TrainingSetup) -> None:
    """The model-parallel degrees against the model (ConfigError naming the field): tp divides the query and
    key/value heads, sequence parallelism and context parallelism divide the sequence (torchtitan's
    ParallelDims.seq_len_divisor: tp, 2 x cp with load balancing), ep needs a mixture-of-experts model whose
    experts it divides; then tp, cp, ep and sequence_parallel are refused as not simulated yet. pp needs a
    hand-written GPT-2 / Llama (nanogpt implementation, dense) with at most n_layer + 2 stages."""
    s = setup
    if s.tp > 1:
        if not isinstance(model, TransformerConfig):
            raise ConfigError("tp", f"tensor parallelism splits attention heads and MLP columns: modelled for "
                                    f"transformers, not {type(model).__name__}")
        for what, heads in (("n_head", model.n_head), ("n_kv_head", model.kv_heads)):
            if heads % s.tp:
                raise ConfigError("tp", f"tp={s.tp} does not divide the model's {what}={heads}: each tensor-parallel "
                                        f"rank holds whole heads")
    if s.sequence_parallel and s.seq_len % s.tp:
        raise ConfigError("sequence_parallel", f"seq_len={s.seq_len} is not a multiple of tp={s.tp}: sequence "
                                               "parallelism splits the sequence over the tensor-parallel ranks")
    if s.cp > 1 and s.seq_len % (2 * s.cp):
        raise ConfigError("cp", f"seq_len={s.seq_len} is not a multiple of 2 x cp = {2 * s.cp} (load-balanced "
                                "context parallelism splits it into 2 x cp chunks)")
    if s.ep > 1:
        experts = getattr(model, "num_local_experts", None)
        if not experts:
            raise ConfigError("ep", f"expert parallelism splits the experts of a mixture-of-experts model; "
                                    f"{getattr(model, 'name', 'this model')!r} has none: drop ep")
        if experts % s.ep:
            raise ConfigError("ep", f"ep={s.ep} does not divide num_local_experts={experts}")
    for name, what, on in (("tp", "tensor parallelism", s.tp > 1), ("cp", "context parallelism", s.cp > 1),
                           ("ep", "expert parallelism", s.ep > 1),
                           ("sequence_parallel", "sequence parallelism", s.sequence_parallel)):
        if on:
            raise ConfigError(name, f"{what} ({name}={getattr(s, name)}) is not simulated yet; allowed for now: "
                                    f"{name} {'false' if name == 'sequence_parallel' else '1'} (of the model-"
                                    "parallel degrees only pp, pipeline parallelism, is simulated)")
    if s.pp == 1:
        return
    if not isinstance(model, TransformerConfig) or model.implementation != "nanogpt" or model.num_local_experts:
        kind = ("an MLP" if isinstance(model, MLPConfig) else "a traced model" if not isinstance(model, TransformerConfig)
                else "a mixture of experts" if model.num_local_experts else f"implementation {model.implementation!r}")
        raise ConfigError("pp", f"pipeline parallelism is simulated for the hand-written GPT-2 and Llama "
                                f"(implementation nanogpt, dense), not {kind} yet")
    if s.pp_schedule not in SIMULATED_SCHEDULES:
        raise ConfigError("pp_schedule", f"{s.pp_schedule}: its order is derived (models/parallel/pipeline.py "
                                         "rank_actions) but its split backward (input gradients, then weight "
                                         "gradients) is not simulated yet; allowed: " + ", ".join(SIMULATED_SCHEDULES))
    stages = s.pp * s.virtual_stages
    if stages > model.n_layer + 2:
        pass  # checked below, once simulated
    raise ConfigError("pp", "pipeline parallelism is not simulated yet (its stage layout and schedules are "
                            "models/parallel/pipeline.py's); allowed for now: pp 1")
    if stages > model.n_layer + 2:
        raise ConfigError("pp", f"pp x virtual_stages = {s.pp} x {s.virtual_stages} = {stages} stages is more than "
                                f"the model's n_layer + 2 = {model.n_layer + 2} (its blocks, the embeddings and the "
                                "output each count as one layer, as torchtitan splits a model): use fewer stages")


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
    n = setup.pp * setup.virtual_stages
    style = "v" if setup.pp_schedule == "zbv" else "loop"
    return [StageSpec(index=s, rank=stage_rank(s, setup.pp, n, style), layers=layers, first=s == 0, last=s == n - 1)
            for s, layers in enumerate(stage_layers(n, n_layer))]


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

