"""Rank classes at scale (models/training.rank_classes): found from the layout functions, never rank by rank,
and equal to the brute force (a builder per rank, grouped by engine signature and checkpoint rank signature)
on small worlds with uneven shapes, for every engine and save mode; the layouts' fast forms against their
plain definitions; the compact member ranges in the metadata, the report and its JSON."""

from __future__ import annotations

import json
import random
import time

import pytest

from peakledger.analysis.report import RankPeak, report_json, summarize
from peakledger.analysis.report_text import render_text
from peakledger.models.checkpoint_io import StateTensor, dcp_writers, rank_signature
from peakledger.models.config import ConfigError, MLPConfig, TrainingSetup
from peakledger.models.devices import device_profile
from peakledger.models.parallel import dim0_ranges, dim0_shard, greedy_owners, greedy_partition
from peakledger.models.presets import preset
from peakledger.models.training import RANK_LIST_LIMIT, GraphBuilder, RankRanges, build_tape, describe, rank_classes
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Category, Pool

# dim 0 of 5, 7, 13, 3 rows and 1-row biases-to-be: not divisible by most worlds, fewer rows than ranks past 3
ODD = MLPConfig(name="odd", d_in=7, hidden=(5, 13), d_out=3, bias=True)
TINY = preset("tiny")  # gpt2 family: 64 / 192 / 256 rows, tied embedding (a state-dict key of its own)
ENGINES = [dict(dp_engine="ddp"), dict(dp_engine="zero-redundancy-optimizer"), dict(dp_engine="fsdp2"),
           dict(zero_stage=0), dict(zero_stage=1), dict(zero_stage=2), dict(zero_stage=3),
           dict(zero_stage=3, stage3_param_persistence_threshold=13)]  # 13-element params stay whole: replicated
SAVES = [dict(), dict(checkpoint_every=1, save_mode="torch-save"), dict(checkpoint_every=1, save_mode="sharded"),
         dict(checkpoint_every=1, save_mode="full-rank0"), dict(checkpoint_every=2, save_mode="async")]


def brute_force(tape, setup, profile) -> dict[int, list[int]]:
    """The definition: one builder per rank, grouped by (engine signature, checkpoint rank signature)."""
    classes: dict[tuple, list[int]] = {}
    for rank in range(setup.mesh.world_size):
        b = GraphBuilder(tape, setup, profile, rank)
        classes.setdefault((b.engine.signature(), rank_signature(b)), []).append(rank)
    return {members[0]: members for members in classes.values()}


def setup_or_none(**kw) -> TrainingSetup | None:
    try:
        return TrainingSetup(micro_batch=2, seq_len=8, steps=2, **kw)
    except ConfigError:  # a combination the setup refuses (zero-redundancy-optimizer with a full state dict)
        return None


def check(model, profile_name="cpu", **kw):
    setup = setup_or_none(**kw)
    if setup is None:
        return None
    profile = device_profile(profile_name)
    tape = build_tape(model, setup, profile.is_cpu)
    fast = rank_classes(tape, setup, profile)
    slow = brute_force(tape, setup, profile)
    assert {r: list(m) for r, m in fast.items()} == slow, kw
    assert list(fast) == list(slow), kw  # the same order: by lowest rank
    return fast


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: "-".join(f"{v}" for v in e.values()))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 16])
def test_analytic_classes_equal_the_brute_force_on_uneven_shapes(engine, world):
    for save in SAVES:
        check(ODD, **engine, **save, world_size=world)


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: "-".join(f"{v}" for v in e.values()))
def test_analytic_classes_equal_the_brute_force_on_a_transformer(engine):
    for world, save in [(3, SAVES[0]), (5, SAVES[1]), (7, SAVES[2]), (40, SAVES[2]), (100, SAVES[1]),
                        (300, SAVES[0])]:
        check(TINY, **engine, **save, world_size=world)


def test_frozen_parameters_still_split_fsdp2_ranks_that_save_their_shards():
    # a frozen parameter's local shard is not in the engine's signature (no optimizer state), but a torch-save
    # writes it: the ranks split where its rows end too
    for world in (3, 4, 6, 16):
        for save in SAVES[:3]:
            check(ODD, dp_engine="fsdp2", frozen=("layers.2.*",), world_size=world, **save)
        check(ODD, dp_engine="zero-redundancy-optimizer", frozen=("layers.0.*",), world_size=world, **SAVES[2])


def test_gpu_profile_and_fp32_mixed_state_sizes():
    for engine in ENGINES:
        check(ODD, "H100-80GB", precision="bf16-mixed", world_size=6, **engine, **SAVES[2])


def test_fsdp2_classes_are_full_partial_and_empty_chunks_per_parameter():
    setup = TrainingSetup(micro_batch=1, world_size=1_000_000, dp_engine="fsdp2")
    profile = device_profile("cpu")
    classes = rank_classes(build_tape(ODD, setup, profile.is_cpu), setup, profile)
    # one row per rank: ranks 0-2 hold a row of every layer, 3-4 of the 5- and 13-row ones, 5-12 of the 13-row ones
    assert {r: m.as_json() for r, m in classes.items()} == {0: [[0, 2]], 3: [[3, 4]], 5: [[5, 12]],
                                                           13: [[13, 999_999]]}


def test_zero_redundancy_ranks_without_parameters_are_one_class():
    setup = TrainingSetup(micro_batch=1, world_size=1_000_000, dp_engine="zero-redundancy-optimizer")
    profile = device_profile("cpu")
    tape = build_tape(ODD, setup, profile.is_cpu)
    t = time.perf_counter()
    classes = rank_classes(tape, setup, profile)
    assert time.perf_counter() - t < 5
    # six parameters, one to each of ranks 0-5 (largest first); every other rank owns none: one class
    assert [m.text() for m in classes.values()] == ["0", "1", "2", "3", "4", "5", "6-999999"]


def test_sharded_saves_split_the_writers_of_replicated_tensors_at_any_world():
    setup = TrainingSetup(micro_batch=1, world_size=1_000_000, dp_engine="ddp", checkpoint_every=1,
                          save_mode="sharded")
    profile = device_profile("cpu")
    classes = rank_classes(build_tape(ODD, setup, profile.is_cpu), setup, profile)
    # DDP replicates everything: 6 parameters x (parameter, exp_avg, exp_avg_sq, step) to ranks 0-23, one each;
    # ranks writing tensors of equal bytes are one class (the signature is the bytes written)
    assert sum(len(m) for m in classes.values()) == 1_000_000
    assert classes[0].ranges[0] == (0, 1) and list(classes.values())[-1].ranges[-1] == (24, 1_000_000)
    small = TrainingSetup(micro_batch=1, world_size=30, dp_engine="ddp", checkpoint_every=1, save_mode="sharded")
    assert {r: list(m) for r, m in rank_classes(build_tape(ODD, small, True), small, profile).items()} == \
        brute_force(build_tape(ODD, small, True), small, profile)


# -- the layouts' fast forms ----------------------------------------------------------------------------

def plain_greedy(numels, world_size):
    sizes = [0] * world_size
    owned = [[] for _ in range(world_size)]
    for name, numel in sorted(numels, key=lambda item: -item[1]):
        rank = sizes.index(min(sizes))
        owned[rank].append(name)
        sizes[rank] += numel
    return owned


def plain_dcp_writers(state, world_size):
    planned = [0] * world_size
    writers = {}
    for t in state:
        if t.replicated:
            r = planned.index(min(planned))
            writers[t.name] = r
            planned[r] += t.nbytes or 1
        else:
            planned[0] += t.nbytes or 1
    return writers


def test_fast_layouts_equal_their_definitions():
    rng = random.Random(14)
    for _ in range(2000):
        n = rng.randint(1, 12)
        numels = [(f"p{i}", rng.choice([0, 1, 2, 3, 8, rng.randint(0, 40)])) for i in range(rng.randint(0, 14))]
        assert greedy_partition(numels, n) == plain_greedy(numels, n)
        owners = greedy_owners(numels, n)
        assert owners == plain_greedy(numels, n)[:len(owners)] and not any(plain_greedy(numels, n)[len(owners):])
        state = [StateTensor(f"t{i}", Category.PARAMETER, "fp32", (), rng.choice([0, 4, 8, rng.randint(0, 99)]), 0, 0,
                             0, 1, rng.random() < 0.7, Pool.DEVICE) for i in range(rng.randint(0, 20))]
        assert dcp_writers(state, n) == plain_dcp_writers(state, n)
        shape = rng.choice([(), (0,), (rng.randint(1, 40),), (rng.randint(1, 40), rng.randint(1, 5))])
        ranges = dim0_ranges(shape, n)
        assert len(ranges) <= 3 and ranges[0][0] == 0
        for r in range(n):
            assert next(numel for first, numel in reversed(ranges) if first <= r) == dim0_shard(shape, n, r)[1]


# -- the compact members ---------------------------------------------------------------------------------

def test_rank_ranges_are_a_sequence_of_ranks():
    ranks = RankRanges([(5, 8), (0, 2), (2, 3)])
    assert ranks.ranges == ((0, 3), (5, 8)) and list(ranks) == [0, 1, 2, 5, 6, 7] and len(ranks) == 6
    assert ranks == [0, 1, 2, 5, 6, 7] and ranks == (0, 1, 2, 5, 6, 7) and ranks != [0, 1]
    assert ranks[0] == 0 and ranks[3] == 5 and ranks[-1] == 7 and ranks[2:4] == [2, 5]
    assert 6 in ranks and 3 not in ranks and -1 not in ranks
    assert ranks.as_json() == [[0, 2], [5, 7]] and ranks.text() == "0-2,5-7"
    assert RankRanges.from_json(ranks.as_json()) == ranks == RankRanges.of([7, 6, 5, 2, 1, 0, 0])
    with pytest.raises(IndexError):
        ranks[6]
    big = RankRanges([(0, 10**6)])
    assert len(big) == 10**6 and big[-1] == 10**6 - 1 and big.as_json() == [[0, 999_999]]


def test_metadata_and_report_list_small_classes_and_range_every_class():
    graph = describe(ODD, TrainingSetup(micro_batch=1, world_size=6, dp_engine="fsdp2", steps=1), "cpu")
    md = graph.metadata
    # rows per rank of the 5-, 13- and 3-row layers: 1, 3, 1 on ranks 0-2; 1, 3, 0; 1, 1, 0; none on rank 5
    assert md.rank_classes == {"0": [0, 1, 2], "3": [3], "4": [4], "5": [5]}
    assert md.rank_class_ranges == {"0": [[0, 2]], "3": [[3, 3]], "4": [[4, 4]], "5": [[5, 5]]}
    out = json.loads(json.dumps(report_json(summarize(simulate(graph)))))
    assert [(r["rank"], r["ranks"], r["rank_ranges"]) for r in out["ranks"]] == \
        [(0, [0, 1, 2], [[0, 2]]), (3, [3], [[3, 3]]), (4, [4], [[4, 4]]), (5, [5], [[5, 5]])]
    # classes of ranks apart: DDP's sharded save gives ranks 0-5 a parameter each, then ranks 6, 7, 8 the first
    # one's Adam step, exp_avg, exp_avg_sq, and so on (0, 7, 8 write the same bytes; 6, 9, ... a step each); 24-29
    # write nothing
    sharded = describe(ODD, TrainingSetup(micro_batch=1, world_size=30, dp_engine="ddp", steps=1, checkpoint_every=1,
                                          save_mode="sharded"), "cpu").metadata
    apart = [r for r, ranges in sharded.rank_class_ranges.items() if len(ranges) > 1]
    assert sharded.rank_class_ranges["0"] == [[0, 0], [7, 8]] and sharded.rank_class_ranges["24"] == [[24, 29]]
    assert apart and all(RankRanges.from_json(sharded.rank_class_ranges[r]) == sharded.rank_classes[r]
                         for r in sharded.rank_classes)


def test_a_million_ranks_keep_the_metadata_and_the_report_small():
    world = 1_000_000
    graph = describe(ODD, TrainingSetup(micro_batch=1, world_size=world, zero_stage=3, steps=1), "cpu")
    assert graph.metadata.rank_classes == {"0": None}  # more than RANK_LIST_LIMIT ranks: not listed
    assert graph.metadata.rank_class_ranges == {"0": [[0, world - 1]]}
    report = summarize(simulate(graph))
    assert report.ranks[0].same_as == RankRanges([(0, world)])
    out = report_json(report)
    assert out["ranks"][0]["ranks"] is None and out["ranks"][0]["rank_ranges"] == [[0, world - 1]]
    assert len(json.dumps(out)) < 100_000
    assert "ranks 0-999999" in render_text(report)
    assert RANK_LIST_LIMIT == 65_536


def test_rank_peak_as_json_takes_a_plain_tuple():
    report = summarize(simulate(describe(ODD, TrainingSetup(micro_batch=1, world_size=2, zero_stage=1, steps=1),
                                         "cpu")))
    rp = RankPeak(rank=0, same_as=(0, 1), peak=report.ranks[0].peak)
    assert rp.as_json()["ranks"] == [0, 1] and rp.as_json()["rank_ranges"] == [[0, 1]]
