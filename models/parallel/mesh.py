"""The device mesh: where a global rank sits in the pp x dp x cp x tp grid, and what it runs.

torchtitan lays its ranks out as `init_device_mesh(dims=("pp", "dp_replicate", "dp_shard", "cp", "tp"))`
(torchtitan/distributed/parallel_dims.py `ParallelDims._build_mesh`): row-major, tp innermost, so the tp ranks of
one group are consecutive global ranks (one node's GPUs) and pp outermost:

    rank = ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp + tp_rank

A rank's work composes the dimensions one after the other, each a transform owned by its module:
  1. tp (tensor/): the whole model's tape rewritten into the rank's shards and collectives (`tp_rank`);
  2. pp (pipeline.py): that tape cut into the rank's stages (`pp_rank`), replayed in the schedule's order;
  3. dp (ddp.py, fsdp.py, deepspeed.py): the data-parallel engine over the dp ranks of the rank's group
     (`dp_rank` of `dp`), on the already tp-sharded and stage-cut parameters, as torchtitan applies FSDP
     after TP and PP.
`rank_builder` puts them together into one GraphBuilder. `mesh_classes` groups the ranks whose work is the same
(one simulation each), as ranges of global ranks, so a million-rank world costs a handful of simulations: a rank's
bytes depend on its tp class (an uneven vocabulary split), its pipeline stage, and its dp class (uneven dim-0
shards); every rank of one pipeline group (same dp, cp and tp coordinates) is simulated together, as the
schedule's sends and receives link them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..builder import GraphBuilder
from ..config import TrainingSetup
from ..rank_ranges import RankRanges
from .context import context_parallel_tape
from .expert import ExpertParallelEngine, expert_classes
from .stages import rank_tape, stage_tapes
from .tensor import TensorParallelEngine, tensor_parallel_classes, tensor_parallel_tape


@dataclass(frozen=True)
class MeshCoords:
    """A rank's coordinate on each mesh dimension."""

    pp: int
    dp: int
    cp: int
    tp: int


def mesh_coords(setup: TrainingSetup, rank: int) -> MeshCoords:
    """The coordinates of global `rank` (tp innermost, pp outermost)."""
    rest, tp = divmod(rank, setup.mesh.tp)
    rest, cp = divmod(rest, setup.mesh.cp)
    pp, dp = divmod(rest, setup.mesh.dp)
    return MeshCoords(pp=pp, dp=dp, cp=cp, tp=tp)


def mesh_rank(setup: TrainingSetup, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
    """The global rank at these coordinates."""
    return ((pp * setup.mesh.dp + dp) * setup.mesh.cp + cp) * setup.mesh.tp + tp


def is_model_parallel(setup: TrainingSetup) -> bool:
    return setup.mesh.tp > 1 or setup.mesh.pp > 1 or setup.mesh.cp > 1 or setup.mesh.ep > 1


def folds_cp(setup: TrainingSetup) -> bool:
    """FSDP2 shards over dp x cp with context parallelism (torchtitan's "dp_shard_cp" mesh: the cp ranks of one
    data-parallel rank hold different sequence chunks of the same batch, and their gradients are reduced with
    the data-parallel ones)."""
    return setup.mesh.cp > 1 and setup.data_parallel.engine == "fsdp2"


def shard_rank(setup: TrainingSetup, at: MeshCoords) -> int:
    """A rank's place in its data-parallel engine's group: its dp coordinate, or dp x cp + cp when FSDP2 folds cp."""
    return at.dp * setup.mesh.cp + at.cp if folds_cp(setup) else at.dp


def local_setup(setup: TrainingSetup) -> TrainingSetup:
    """The setup one rank's data-parallel engine and pipeline see: its tape is already tensor-parallel, so tp = 1,
    and the world is its pipeline's ranks times its data-parallel group (`dp` unchanged; dp x cp when FSDP2
    folds cp, `folds_cp`)."""
    if setup.mesh.tp == 1 and setup.mesh.cp == 1:
        return setup
    group = setup.mesh.dp * setup.mesh.cp if folds_cp(setup) else setup.mesh.dp
    return setup.replace(tp=1, cp=1, sequence_parallel=False, world_size=group * setup.mesh.pp)


class MeshTapes:
    """The tapes of a mesh's positions, each made once and shared by the ranks at that position: the tensor-parallel
    tape of a tp rank (`tp_tape`), the pipeline rank tape of a (tp rank, pp rank) (`rank_tape`), the tape of an
    expert-parallel rank (`ep_tape`: `build(ep_rank)` describes it, its own experts and dispatch)."""

    def __init__(self, tape, setup: TrainingSetup, build=None) -> None:
        self.tape, self.setup, self.local = tape, setup, local_setup(setup)
        self.build = build
        self._ep: dict[int, object] = {0: tape}
        self._tp: dict[tuple[int, int], object] = {}
        self._cuts: dict[tuple[int, int], list] = {}
        self._ranks: dict[tuple[int, int, int], object] = {}

    def tp_tape(self, tp: int, cp: int = 0):
        """The tape of tensor-parallel rank `tp` and context-parallel rank `cp` (tensor/, then context.py)."""

        if (tp, cp) not in self._tp:
            s = self.setup
            local = (tensor_parallel_tape(self.tape, s.mesh.tp, s.mesh.sequence_parallel, tp, untied=s.mesh.pp > 1)
                     if s.mesh.tp > 1 else self.tape)
            self._tp[(tp, cp)] = context_parallel_tape(local, s.mesh.cp, cp) if s.mesh.cp > 1 else local
        return self._tp[(tp, cp)]

    def ep_tape(self, ep_rank: int):
        if ep_rank not in self._ep:
            self._ep[ep_rank] = self.build(ep_rank)
        return self._ep[ep_rank]

    def rank_tape(self, tp: int, pp: int, cp: int = 0):

        if self.setup.mesh.pp == 1:
            return self.tp_tape(tp, cp)
        if (tp, cp, pp) not in self._ranks:
            if (tp, cp) not in self._cuts:
                self._cuts[(tp, cp)] = stage_tapes(self.tp_tape(tp, cp), self.local)
            self._ranks[(tp, cp, pp)] = rank_tape(self.tp_tape(tp, cp), self.local, pp, self._cuts[(tp, cp)])
        return self._ranks[(tp, cp, pp)]


def rank_builder(tape, setup: TrainingSetup, profile, rank: int, graph=None, block_ids=None,
                 tapes: MeshTapes | None = None):
    """The GraphBuilder of global `rank`: the tape made tensor-parallel (its tp coordinate) and context-parallel
    (its cp coordinate), cut into its pipeline stages (its pp coordinate), replayed under the data-parallel engine
    of its dp coordinate (with cp when FSDP2 folds it, `shard_rank`); the tensor-parallel hooks wrap that engine.
    Blocks and ops carry the global rank. `tapes` shares the local tapes
    between the builders of one description."""

    tapes = tapes if tapes is not None else MeshTapes(tape, setup)
    at = mesh_coords(setup, rank)
    if setup.mesh.ep > 1:  # expert parallelism with dp only (checks.py): the experts of ep rank dp % ep
        local = tapes.ep_tape(at.dp % setup.mesh.ep)
        builder = GraphBuilder(local, setup, profile, rank, graph, block_ids)
        builder.engine = ExpertParallelEngine(builder.engine, local)
        return builder
    builder = GraphBuilder(tapes.rank_tape(at.tp, at.pp, at.cp), tapes.local, profile, rank, graph, block_ids,
                     dp_rank=shard_rank(setup, at), pipeline_group=mesh_rank(setup, 0, at.dp, at.cp, at.tp))
    if setup.mesh.tp > 1:
        builder.engine = TensorParallelEngine(builder.engine, tapes.tp_tape(at.tp, at.cp))
    return builder


def mesh_classes(tapes: MeshTapes, profile, dp_classes) -> dict:
    """{representative global rank: RankRanges} for a model-parallel setup. `dp_classes(builder)` gives the
    data-parallel classes of one (tp, pp) position as [(first dp rank, stop)] ranges keyed by signature
    ({signature: [(start, stop), ...]}). A pipeline group is simulated whole, so the dp classes of all stages
    of a tp class are refined together: one pipeline group per refined dp range."""

    setup = tapes.setup
    if setup.mesh.ep > 1:  # expert parallelism with dp only: ranks that receive the same rows in every layer are alike
        return expert_classes(tapes.ep_tape, setup)
    if setup.mesh.cp > 1:  # context parallelism alone (models/parallel/checks.py check_context_parallel_supported):
        return {r: RankRanges([(r, r + 1)]) for r in range(setup.mesh.world_size)}  # the ring differs by rank
    tp_groups = tensor_parallel_classes(tapes.tape, setup) if setup.mesh.tp > 1 else {0: RankRanges([(0, 1)])}
    out: dict[int, RankRanges] = {}
    for tp_rep, tp_members in tp_groups.items():
        per_stage = []
        for pp in range(setup.mesh.pp):
            b = rank_builder(tapes.tape, setup, profile, mesh_rank(setup, pp, 0, 0, tp_rep), tapes=tapes)
            per_stage.append(dp_classes(b))
        cuts = sorted({start for classes in per_stage for ranges in classes.values() for start, _ in ranges})
        refined = [(a, cuts[k + 1] if k + 1 < len(cuts) else setup.mesh.dp) for k, a in enumerate(cuts)]
        # a stage's class: the refined ranges inside one of its own classes; one rep per refined range is simulated
        reps = {}
        for pp, classes in enumerate(per_stage):
            owner = {start: key for key, ranges in classes.items() for start, stop in ranges}
            starts = sorted(owner)
            groups: dict = {}
            for a, stop in refined:
                key = owner[max(s for s in starts if s <= a)]
                groups.setdefault(key, []).append((a, stop))
            for ranges in groups.values():
                first = ranges[0][0]
                members = _member_ranges(setup, pp, ranges, tp_members)
                reps[(pp, first)] = RankRanges(members)
        # every refined range's pipeline group is simulated: its stages that share a class with a lower range are
        # simulated again (their bytes are the same), and only the class representatives are reported
        for (pp, first), members in sorted(reps.items()):
            out[mesh_rank(setup, pp, first, 0, tp_rep)] = members
    return dict(sorted(out.items()))


def _member_ranges(setup: TrainingSetup, pp: int, ranges, tp_members):
    """Global rank ranges of (pp, dp in ranges, any cp, tp in `tp_members`, a RankRanges): each of its ranges of tp
    ranks is one range of global ranks; with every tp rank a member, consecutive dp ranks are too."""
    tp_runs = tp_members.ranges
    whole_tp = tp_runs == ((0, setup.mesh.tp),)
    for a, stop in ranges:
        if whole_tp:
            yield (
                mesh_rank(setup, pp, a, 0, 0),
                mesh_rank(setup, pp, stop - 1, setup.mesh.cp - 1, setup.mesh.tp - 1) + 1,
            )
            continue
        for d, cp in itertools.product(range(a, stop), range(setup.mesh.cp)):
            for t0, t1 in tp_runs:
                yield mesh_rank(setup, pp, d, cp, t0), mesh_rank(setup, pp, d, cp, t1 - 1) + 1


def simulated_ranks(classes: dict, setup: TrainingSetup) -> list[int]:
    """The global ranks to simulate for `classes`: with pipeline parallelism every stage of each representative's
    pipeline group (the schedule needs them all), else the representatives."""
    if setup.mesh.pp == 1:
        return list(classes)
    ranks = set()
    for rep in classes:
        at = mesh_coords(setup, rep)
        ranks.update(mesh_rank(setup, pp, at.dp, at.cp, at.tp) for pp in range(setup.mesh.pp))
    return sorted(ranks)


__all__ = ["MeshTapes", "MeshCoords", "mesh_coords", "mesh_rank", "is_model_parallel", "local_setup", "rank_builder",
           "folds_cp", "shard_rank",
           "mesh_classes", "simulated_ranks"]
