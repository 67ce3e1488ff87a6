"""The allocator model's rules (simulator/allocator.py), each on a small request sequence whose expected result is
worked out by hand from the rule, and the replay of every real snapshot of ../shared/gpu-truth."""

from __future__ import annotations

from pathlib import Path

import pytest

from peakledger.analysis.allocator_replay import replay_entries, replay_snapshot, start_state
from peakledger.simulator.allocator import (
    AllocatorConfig,
    AllocatorConfigError,
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    pool_of,
    round_size,
)

MB = 1 << 20
GPU_TRUTH = Path(__file__).resolve().parent.parent.parent / "shared" / "gpu-truth" / "snapshots"


def addresses(*addrs):
    """A segment_address callback handing out the given addresses in turn."""
    it = iter(addrs)
    return lambda size, stream: next(it)


def seg_events(model):
    return [(e.kind, e.size) for e in model.events]


def test_round_size_to_512():
    # round_size: multiples of kMinBlockSize = 512 B, at least 512 B
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1024, 1536]


def test_pools_and_segment_sizes():
    # get_pool: rounded <= 1 MiB is small; get_allocation_size: 2 MiB / 20 MiB below 10 MiB / rounded to 2 MiB
    assert pool_of(round_size(MB)) == "small" and pool_of(round_size(MB + 1)) == "large"
    assert allocation_size(round_size(MB)) == 2 * MB
    assert allocation_size(round_size(MB + 1)) == 20 * MB
    assert allocation_size(round_size(10 * MB - 512)) == 20 * MB
    assert allocation_size(round_size(10 * MB)) == 10 * MB
    assert allocation_size(round_size(11 * MB + 1)) == 12 * MB
    m = CachingAllocator()
    m.malloc(MB)
    m.malloc(MB + 1)  # 1 MiB + 512 B from a new 20 MiB segment; 19 MiB - 512 B split off
    m.malloc(11 * MB + 1)  # 11 MiB + 512 B fits in that remainder: no new segment
    m.malloc(11 * MB + 1)  # 8 MiB - 1 KiB left is too small: a new segment of 11 MiB + 512 B rounded to 12 MiB
    assert seg_events(m) == [("segment_alloc", 2 * MB), ("segment_alloc", 20 * MB), ("segment_alloc", 12 * MB)]
    assert m.reserved == 34 * MB


def test_small_pool_split_and_reuse():
    # a 1000 B request takes 1024 B of a new 2 MiB segment; the rest (>= 512 B) is split off and serves the next one
    m = CachingAllocator(segment_address=addresses(0x1000_0000))
    a = m.malloc(1000)
    b = m.malloc(1000)
    assert (a, b) == (0x1000_0000, 0x1000_0000 + 1024)
    assert seg_events(m) == [("segment_alloc", 2 * MB)]
    assert m.allocated == 2048 and m.requested == 2000
    assert m.layout()[0x1000_0000][-1] == (0x1000_0000 + 2048, 2 * MB - 2048, False)


def test_large_pool_split_threshold():
    # 19 MiB from a 20 MiB segment leaves exactly 1 MiB: not > 1 MiB, so the block keeps it (allocated 20 MiB)
    m = CachingAllocator()
    m.malloc(19 * MB)
    assert m.allocated == 20 * MB and len(m.layout()[next(iter(m.layout()))]) == 1
    # 19 MiB - 512 B leaves 1 MiB + 512 B: split off as a free block
    m = CachingAllocator()
    m.malloc(19 * MB - 512)
    assert m.allocated == 19 * MB - 512
    assert [blk[1:] for blk in m.layout()[next(iter(m.layout()))]] == [(19 * MB - 512, True), (MB + 512, False)]


def test_best_fit_ties_lowest_address():
    # free cached blocks of 12, 14 and 12 MiB; an 11 MiB request takes a 12 MiB one, the lower address first,
    # then the other 12 MiB one, then the 14 MiB one (split: 3 MiB > 1 MiB left); no new segment
    m = CachingAllocator(segment_address=addresses(3 << 30, 2 << 30, 1 << 30))
    a, b, c = m.malloc(12 * MB), m.malloc(14 * MB), m.malloc(12 * MB)
    for x in (a, b, c):
        m.free(x)
    assert [m.malloc(11 * MB) for _ in range(3)] == [1 << 30, 3 << 30, 2 << 30]
    assert len(m.events) == 3
    assert m.allocated == 12 * MB + 12 * MB + 11 * MB


def test_streams_do_not_share_cached_blocks():
    m = CachingAllocator()
    m.free(m.malloc(4096, stream=0))
    m.malloc(4096, stream=1)
    assert seg_events(m) == [("segment_alloc", 2 * MB)] * 2
    m.malloc(4096, stream=0)  # the cached block of stream 0 serves stream 0
    assert len(m.events) == 2


def test_merge_with_free_neighbours():
    m = CachingAllocator(segment_address=addresses(0x2000_0000))
    x, y, z = m.malloc(512), m.malloc(512), m.malloc(512)
    m.free(x)
    m.free(z)
    # [x free 512][y allocated 512][z merged with the rest: 2 MiB - 1024]
    assert m.layout()[0x2000_0000] == [(x, 512, False), (y, 512, True), (z, 2 * MB - 1024, False)]
    assert m.empty_cache() == 0  # the segment is split: nothing to release
    m.free(y)
    assert m.layout()[0x2000_0000] == [(x, 2 * MB, False)]
    assert m.empty_cache() == 2 * MB and m.reserved == 0


def test_empty_cache_order_large_then_small_by_size():
    m = CachingAllocator(segment_address=addresses(10 << 30, 20 << 30, 30 << 30, 40 << 30))
    blocks = [m.malloc(4096), m.malloc(30 * MB), m.malloc(12 * MB), m.malloc(12 * MB)]
    for x in blocks:
        m.free(x)
    m.events.clear()
    m.empty_cache()
    assert [(e.kind, e.size, e.addr) for e in m.events] == [
        ("segment_free", 12 * MB, 30 << 30), ("segment_free", 12 * MB, 40 << 30),
        ("segment_free", 30 * MB, 20 << 30), ("segment_free", 2 * MB, 10 << 30)]


def test_retry_after_freeing_the_cache_then_oom():
    # capacity 40 MiB: 12 MiB cached + a new 30 MiB segment would be 42 MiB, so the cache is freed and cudaMalloc
    # retried; then 30 MiB allocated + 12 MiB more cannot fit even with an empty cache: OOM
    m = CachingAllocator(capacity=40 * MB)
    m.free(m.malloc(12 * MB))
    m.malloc(30 * MB)
    assert seg_events(m) == [("segment_alloc", 12 * MB), ("segment_free", 12 * MB), ("segment_alloc", 30 * MB)]
    with pytest.raises(OutOfMemory):
        m.malloc(12 * MB)
    assert m.reserved == 30 * MB and m.ooms == 1


def test_max_split_size_oversize_blocks():
    cfg = AllocatorConfig.parse("max_split_size_mb:32")
    assert cfg.max_split_size == 32 * MB
    m = CachingAllocator(cfg)
    m.free(m.malloc(40 * MB))
    # 21 MiB < 32 MiB may not take the cached oversize 40 MiB block: a new 22 MiB segment
    m.free(m.malloc(21 * MB))
    assert seg_events(m) == [("segment_alloc", 40 * MB), ("segment_alloc", 22 * MB)]
    # 36 MiB >= 32 MiB takes the 40 MiB block (40 < 36 + 20) and does not split it (oversize)
    m.malloc(36 * MB)
    assert len(m.events) == 2 and m.allocated == 40 * MB
    # an oversize request does not take a cached block 20 MiB or more bigger than itself
    m2 = CachingAllocator(cfg)
    m2.free(m2.malloc(60 * MB))
    m2.malloc(36 * MB)
    assert seg_events(m2) == [("segment_alloc", 60 * MB), ("segment_alloc", 36 * MB)]


def test_max_split_size_release_oversize_before_everything():
    # with max_split_size set, a failed cudaMalloc first frees the smallest cached oversize block >= the key
    cfg = AllocatorConfig.parse("max_split_size_mb:32")
    m = CachingAllocator(cfg, capacity=100 * MB)
    a, b, _ = m.malloc(40 * MB), m.malloc(34 * MB), m.malloc(2 * MB)
    m.free(a)
    m.free(b)
    m.events.clear()
    # reserved: 40 + 34 + 20 (2 MiB is a large-pool request: a 20 MiB segment) = 94 MiB. 24 MiB < 32 MiB may not
    # take an oversize cached block; cudaMalloc of 24 MiB fails (118 > 100); the key is max(24, 32) = 32 MiB: the
    # smallest cached block >= 32 MiB (34 MiB) is freed and the retry fits (84 MiB)
    m.malloc(24 * MB)
    assert seg_events(m) == [("segment_free", 34 * MB), ("segment_alloc", 24 * MB)]


def test_config_parsing():
    assert AllocatorConfig.parse("") == AllocatorConfig()
    assert AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:False") == AllocatorConfig(128 * MB)
    for text, word in [("backend:cudaMallocAsync", "backend"),  # another allocator altogether
                       ("expandable_segments:Yes", "expandable_segments"),
                       ("max_split_size_mb:20", "max_split_size_mb"), ("max_split_size_mb:lots", "max_split_size_mb"),
                       ("colour:blue", "colour")]:
        with pytest.raises(AllocatorConfigError, match=word):
            AllocatorConfig.parse(text)


def _started_mid_run() -> dict:
    """A large segment A whose block (19 MiB asked, 20 MiB kept: 1 MiB leftover) was allocated before recording,
    and a small segment B cached before recording and released by an empty_cache in the trace."""
    A, B = 0x7000_0000, 0x9000_0000
    return {"segments": [{"device": 0, "address": A, "total_size": 20 * MB, "stream": 0, "segment_type": "large",
                          "blocks": [{"address": A, "size": 20 * MB, "requested_size": 19 * MB,
                                      "state": "active_allocated"}]}],
            "device_traces": [[{"action": "segment_free", "addr": B, "size": 2 * MB, "stream": 0},
                               {"action": "free_requested", "addr": A, "size": 19 * MB, "stream": 0},
                               {"action": "free_completed", "addr": A, "size": 19 * MB, "stream": 0},
                               {"action": "alloc", "addr": A, "size": 19 * MB, "stream": 0}]]}


def test_start_state_undoes_the_trace():
    # a large segment A whose block (19 MiB asked, 20 MiB kept: 1 MiB leftover) was allocated before recording, and
    # a small segment B cached before recording and released by an empty_cache in the trace
    A, B = 0x7000_0000, 0x9000_0000
    snap = _started_mid_run()
    segs, blocks = start_state(snap, snap["device_traces"][0])
    assert segs == {A: (20 * MB, 0, "large"), B: (2 * MB, 0, "small")}
    assert blocks == {A: (20 * MB, 19 * MB)}
    r = replay_entries(snap)
    assert (r["segments_matched"], r["segments_measured"]) == (1, 1)
    assert r["reserved_exact_fraction"] == 1.0 and r["final_layout_matches"]
    assert r["reserved_peak"] == {"measured": 22 * MB, "predicted": 22 * MB}


SNAPSHOTS = sorted(p.name for p in GPU_TRUTH.glob("*.pickle")) if GPU_TRUTH.is_dir() else []


@pytest.mark.skipif(not GPU_TRUTH.is_dir(), reason="../shared/gpu-truth is not beside this checkout")
@pytest.mark.parametrize("snapshot", SNAPSHOTS)
def test_replay_real_snapshot(snapshot):
    # reached on all 11 shared snapshots (torch 2.6, default settings): every segment event, reserved after every
    # trace event, both peaks, every block address and the final layout block by block
    r = replay_snapshot(GPU_TRUTH / snapshot)
    assert r["segments_matched"] == r["segments_measured"] == r["segments_predicted"]
    assert r["reserved_exact_fraction"] == 1.0
    assert r["reserved_peak"]["predicted"] == r["reserved_peak"]["measured"]
    assert r["allocated_peak"]["predicted"] == r["allocated_peak"]["measured"]
    assert r["block_addresses_matched"] == r["allocs"]
    assert r["final_layout_matches"] and not r["ooms"]


def _small_snapshot_file(tmp_path):
    import pickle
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(_started_mid_run()))
    return path


def test_replay_command_json_and_text(tmp_path, capsys):
    import json

    from peakledger.cli import main
    path = _small_snapshot_file(tmp_path)
    assert main(["replay", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"segments_measured", "segments_matched", "reserved_peak", "allocated_peak",
            "reserved_exact_fraction"} <= set(data)
    assert data["reserved_peak"]["measured"] == data["reserved_peak"]["predicted"] == 22 * MB
    assert main(["replay", str(path), "--unit", "MiB"]) == 0
    assert "segment events matched  1 of 1 measured" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [(["--alloc-conf", "backend:cudaMallocAsync"], "alloc_conf: "),
                                        (["--alloc-conf", "no_such_key:1"], "alloc_conf: unknown allocator setting"),
                                        (["--capacity", "lots"], "capacity")])
def test_replay_command_bad_input_exits_2(tmp_path, capsys, argv, words):
    from peakledger.cli import main
    assert main(["replay", str(_small_snapshot_file(tmp_path)), *argv]) == 2
    assert words in capsys.readouterr().err


def _retry_snapshot() -> dict:
    """15 MiB allocated and freed (a 16 MiB segment cached), then 17 MiB asked: its 18 MiB segment does not fit beside
    the cached one, so torch frees the cache and retries: segment_free 16 MiB, then segment_alloc 18 MiB."""
    S1, S2 = 0x7000_0000, 0x8000_0000
    return {"segments": [{"device": 0, "address": S2, "total_size": 18 * MB, "stream": 0, "segment_type": "large",
                          "blocks": [{"address": S2, "size": 18 * MB, "requested_size": 17 * MB,
                                      "state": "active_allocated"}]}],
            "device_traces": [[{"action": "segment_alloc", "addr": S1, "size": 16 * MB, "stream": 0},
                               {"action": "alloc", "addr": S1, "size": 15 * MB, "stream": 0},
                               {"action": "free_requested", "addr": S1, "size": 15 * MB, "stream": 0},
                               {"action": "free_completed", "addr": S1, "size": 15 * MB, "stream": 0},
                               {"action": "segment_free", "addr": S1, "size": 16 * MB, "stream": 0},
                               {"action": "segment_alloc", "addr": S2, "size": 18 * MB, "stream": 0},
                               {"action": "alloc", "addr": S2, "size": 17 * MB, "stream": 0}]]}


def test_capacity_inferred_from_a_free_and_retry_and_the_retry_replayed():
    r = replay_entries(_retry_snapshot())
    # the cudaMalloc of 18 MiB failed beside 16 MiB reserved (capacity < 34 MiB) and succeeded once they were
    # freed (capacity >= 18 MiB): the least consistent capacity, 18 MiB, reproduces the retry by the rule alone
    assert (r["capacity_inferred"]["low"], r["capacity_inferred"]["high"]) == (18 * MB, 34 * MB - 1)
    assert r["capacity"] == 18 * MB and "free-and-retry" in r["capacity_inferred"]["how"]
    assert r["segments_matched"] == r["segments_measured"] == 3 and r["reserved_exact_fraction"] == 1.0
    # a trace that never reaches the limit: the capacity is only bounded below, and the replay needs none
    quiet = replay_entries({"segments": [{"device": 0, "address": 0x7000_0000, "total_size": 16 * MB, "stream": 0,
                                          "segment_type": "large", "blocks": [{"address": 0x7000_0000, "size": 16 * MB,
                                                                              "state": "inactive"}]}],
                            "device_traces": [_retry_snapshot()["device_traces"][0][:4]]})
    assert quiet["capacity"] is None and quiet["capacity_inferred"]["low"] == 16 * MB


def test_capacity_from_an_oom_entry():
    entries = [{"action": "segment_alloc", "addr": 0, "size": 20 * MB}, {"action": "alloc", "addr": 0, "size": 4 * MB},
               {"action": "oom", "addr": 0, "size": 30 * MB, "device_free": 12 * MB}]
    from peakledger.analysis.allocator_replay import infer_capacity
    assert infer_capacity(entries, 2 * MB)["capacity"] == 2 * MB + 20 * MB + 12 * MB
