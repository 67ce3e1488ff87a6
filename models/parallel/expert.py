"""Expert parallelism (EP) as torchtitan's `ExpertParallel` runs it: one rank's experts and its token dispatch and
combine, written into the rank's tape.

With `ep` ranks, rank r owns E_l = E / ep experts, [r x E_l, (r + 1) x E_l), of every MoE layer (Shard(0) of the
3-D expert weights: torchtitan/distributed/expert_parallel.py `ExpertParallel._partition_fn`). Every rank routes
its own tokens; the (token, expert) rows go to the experts' ranks and back (`_token_dispatch`, `_token_combine`):

    counts    the per-expert counts all-to-all'd (E int64), the splits read on the host;
    dispatch  the S = tokens x top-k sorted rows all-to-all'd into R rows from every rank for this rank's experts
              (Megatron-LM's `_AllToAll`: a new tensor; its backward the same with the splits swapped);
    permute   a zero row appended (vstack: R + 1 rows), then the rows gathered by local expert, each expert's
              group padded to a multiple of TOKEN_GROUP_ALIGN_SIZE_M (8) rows (at least 8): a buffer of
              P = round_up(R + E_l x 8, 8) rows (`_permute`, `generate_permute_indices`);
    experts   the two grouped matmuls on the P rows and the E_l local experts;
    unpermute an (R + 1)-row buffer the rows are put back into, its first R rows a view (`_unpermute`);
    combine   the R rows all-to-all'd back into S rows, which the model weighs and un-sorts as without EP.

R comes from the routing (`models.moe.routing_counts`, the `moe_routing` input): every rank routes like the
counts (balanced, worst, or a measured counts file), so rank r receives ep x (tokens its experts get from one
rank). Worst routing sends every token of every rank to experts 0..k-1: rank 0 receives ep x S rows, the others
none (their P is the padding alone). Checked against real runs (traces/expert_run.py: HF Mixtral with these
experts and this dispatch, on gloo).

What no TapeOp can say is kept on `ExpertParallelTape` and done by `ExpertParallelEngine`, a thin wrapper of the
rank's data-parallel engine: the backward of the unpermute view (SliceBackward: the R-row gradient the combine's
backward made grows into a new (R + 1)-row one, the R-row one freed), and the all-to-alls' transfers on the
communication stream. The dense parameters are the data-parallel engine's (DDP, which ignores the experts).
Ranks are laid out as Megatron-LM lays them with tp = 1: expert-parallel groups of ep consecutive ranks (ep rank =
dp rank % ep). With dp = ep every expert lives on one rank; with dp a multiple of ep, the ranks holding the same
experts average the experts' gradients in place before the optimizer step (Megatron's expert-data-parallel
all-reduce: no memory, a transfer on the communication stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...simulator.events import Category, Phase, Stream
from ..rank_ranges import RankRanges
from ..replay import replace_grad
from ..tape import Tape, TensorSpec

TOKEN_GROUP_ALIGN_SIZE_M = 8  # torchtitan/distributed/expert_parallel.py: rows of an expert's group, bf16 / fp32
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


@dataclass
class ExpertParallelTape(Tape):
    """A Mixtral tape of one expert-parallel rank: its experts' weights local (`local_params`, which the
    data-parallel engine leaves out of its gradient sync), plus `slices`: {combine op name: (the R-row view it
    reads, the (R + 1)-row buffer's spec)}, whose gradient grows after that op's backward."""

    ep: int = 1
    ep_rank: int = 0
    local_params: tuple[str, ...] = ()
    slices: dict[str, tuple[str, TensorSpec]] = field(default_factory=dict)
    received_rows: tuple[tuple[int, ...], ...] = ()  # per MoE layer, source-rank major, local-expert minor

    @property
    def n_params(self) -> int:
        """The whole model's parameters (every rank's experts)."""
        return sum(p.numel * (self.ep if p.name in self.local_params else 1) for p in self.params)


def local_experts(num_experts: int, ep: int, rank: int) -> range:
    per = num_experts // ep
    return range(rank * per, (rank + 1) * per)


def received(counts, ep: int, rank: int) -> list[int]:
    """Rows rank `rank` receives, source-rank major, local-expert minor (every rank routes like `counts`)."""
    mine = [counts[e] for e in local_experts(len(counts), ep, rank)]
    return [n for _ in range(ep) for n in mine]


def padded_rows(got: list[int], ep: int, align: int = TOKEN_GROUP_ALIGN_SIZE_M) -> int:
    """torchtitan `_permute`'s buffer: round_up(rows + E_l x align, align)."""
    local = len(got) // ep
    return -(-(sum(got) + local * align) // align) * align


def expert_dispatch(w, x: str, gathered: TensorSpec, hist: TensorSpec, counts, E: int):
    """The ops from the histogram to the permuted rows (see the module notes), on rank `w.ep_rank` of
    `w.setup.mesh.ep`: returns (the P permuted rows, R the rows received, the permutation's indices, the groups'
    offsets, the locals released when the experts return). The rows received in this layer are appended to
    `w.tape.received_rows`."""
    ep = w.setup.mesh.ep
    S, D = gathered.shape
    got = received(counts, ep, w.ep_rank)
    R, P, E_l = sum(got), padded_rows(got, ep), E // ep
    w.tape.received_rows += (tuple(got),)
    dt = gathered.dtype
    # the counts exchanged (no grad): the histogram as int64, the received counts (locals until the return)
    (sent,) = w.op(f"{x}.counts", "to_copy", [hist], [w.t(f"{x}.counts", (E,), "int64", False)])
    (recv,) = w.op(f"{x}.counts_all_to_all", "all_to_all", [sent],
                   [w.t(f"{x}.received_counts", (E,), "int64", False)])
    (routed,) = w.op(f"{x}.dispatch", "all_to_all", [gathered], [w.t(f"{x}.dispatched", (R, D), dt)])
    # _permute: the indices and offsets (no grad), vstack with a zero row (two blocks here: the R rows and the
    # appended one; CatBackward hands the R rows' gradient on as a view), the rows gathered by local expert
    idx, offs = w.op(f"{x}.permute_indices", "tensor", [], [w.t(f"{x}.permuted_indices", (P,), "int32", False),
                                                            w.t(f"{x}.offsets", (E_l,), "int32", False)])
    stacked, pad = w.op(f"{x}.permute.vstack", "cat", [routed], [w.t(f"{x}.stacked", (R, D), dt),
                                                                 w.t(f"{x}.stacked_zero_row", (1, D), dt)],
                        passthrough=True, workspace=(w.t(f"{x}.zero_row", (D,), dt, False),))
    (permuted,) = w.op(f"{x}.permute", "index", [stacked, pad, idx], [w.t(f"{x}.permuted", (P, D), dt)],
                       saves=(idx.name,), bwd_workspace=(w.t(f"{x}.permute.zeros", (R + 1, D), dt, False),))
    w.release(f"{x}.permute.return", [stacked, pad, routed])
    return permuted, R, idx, offs, (sent, recv, gathered)


def expert_combine(w, x: str, down: TensorSpec, idx: TensorSpec, R: int, S: int) -> TensorSpec:
    """`_unpermute` into an (R + 1)-row buffer (written as its R-row view and its last row), the grouped matmul's
    output dropped, then the all-to-all back into the S rows (returned)."""
    D = down.shape[1]
    dt = down.dtype
    view, last = w.op(f"{x}.unpermute", "index_put", [down, idx], [w.t(f"{x}.returning", (R, D), dt),
                                                                   w.t(f"{x}.returning_last_row", (1, D), dt, False)],
                      saves=(idx.name,))
    w.release(f"{x}.unpermute.return", [down])
    (back,) = w.op(f"{x}.combine", "all_to_all", [view], [w.t(f"{x}.combined", (S, D), dt)])
    w.tape.slices[f"{x}.combine"] = (view.name, TensorSpec(f"{view.name}.full", (R + 1, D), dt))
    w.release(f"{x}.combine.return", [view, last])
    return back


class ExpertParallelEngine:
    """A rank's data-parallel engine (`inner`) plus the hooks an `ExpertParallelTape` needs: the all-to-alls'
    transfers on the communication stream, and the unpermute view's backward. Every other attribute is the inner
    engine's."""

    def __init__(self, inner, tape: ExpertParallelTape) -> None:
        self.inner = inner
        self.tape = tape

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        self.inner.after_op(replay, i, phase, recompute)
        op = replay.tape.ops[i]
        if op.kind != "all_to_all":
            return
        builder = replay.builder
        nbytes = max(sum(o.nbytes for o in op.outputs), sum(replay.specs[n].nbytes for n in op.inputs))
        builder.op(
            f"{op.name}.transfer" if phase is Phase.FORWARD else f"{op.name}.backward.transfer",
            phase,
            replay.step,
            replay.mb,
            [],
            [],
            stream=Stream.COMMUNICATION,
            duration=builder.device.collective_duration("all_to_all", nbytes, self.tape.ep),
            after=(builder.last(Stream.COMPUTE),),
        )
        if phase is Phase.BACKWARD and not recompute and op.name in self.tape.slices:
            self._slice_backward(replay, *self.tape.slices[op.name])

    def before_step(self, step: int, grads):
        """With dp > ep, the experts' replicas all-reduce their gradients in place first (no new memory)."""
        ep, dp = self.tape.ep, self.inner.setup.mesh.dp
        if dp > ep:
            builder = self.inner.builder
            nbytes = sum(grads.blocks[p].nbytes for p in self.tape.local_params if p in grads.blocks)
            builder.op(
                "experts.grad_all_reduce",
                Phase.OPTIMIZER,
                step,
                -1,
                [],
                [],
                stream=Stream.COMMUNICATION,
                duration=builder.device.collective_duration("all_reduce", nbytes, dp // ep),
                after=(builder.last(Stream.COMPUTE),),
            )
        return self.inner.before_step(step, grads)

    def _slice_backward(self, replay, view: str, full: TensorSpec) -> None:
        """SliceBackward of `out[:-1]`: a new gradient of the whole buffer, the view's gradient freed."""

        if view not in replay.grad_of:
            return
        builder = replay.builder
        grown = builder.block(f"{view}.grad_slice_backward", full.nbytes, Category.TEMPORARY, full.dtype, full.shape)
        frees = replace_grad(replay, view, grown)
        builder.op(f"{view}.slice.backward", Phase.BACKWARD, replay.step, replay.mb, [grown], frees,
             bytes_moved=2 * full.nbytes)


def expert_classes(tape_of, setup) -> dict:
    """{representative rank: RankRanges}: with world_size = dp, ranks whose tapes receive the same rows in every
    layer are identical (balanced routing: one class; otherwise one per ep rank, its ranks every ep-th)."""

    groups: dict[tuple, list[int]] = {}
    for r in range(setup.mesh.world_size):
        groups.setdefault(tape_of(r % setup.mesh.ep).received_rows, []).append(r)
    return {ranks[0]: RankRanges([(r, r + 1) for r in ranks]) for ranks in groups.values()}


def expert_metadata(tape_of, classes, setup, top_k: int) -> dict:
    """What the report says of expert parallelism: experts per rank, the routing, and the rows each class of
    ranks receives per MoE layer (each rank sends tokens x `top_k`)."""
    first = tape_of(0)
    experts = next(p.shape[0] for p in first.params if p.name in first.local_params)
    return {
        "ep": setup.mesh.ep,
        "experts_per_rank": experts,
        "routing": setup.moe.routing or "balanced",
        "sent_rows": setup.batch.micro_batch * setup.batch.seq_len * top_k,
        "received_rows": {str(r): [sum(rows) for rows in tape_of(r % setup.mesh.ep).received_rows] for r in classes},
    }


__all__ = ["ExpertParallelTape", "ExpertParallelEngine", "TOKEN_GROUP_ALIGN_SIZE_M", "EXPERT_WEIGHTS", "local_experts",
           "received", "padded_rows", "expert_dispatch", "expert_combine", "expert_classes", "expert_metadata"]
