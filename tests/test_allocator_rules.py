"""The allocator settings the model adds to torch's defaults (simulator/allocator/): expandable segments,
roundup_power2_divisions, garbage_collection_threshold, max_non_split_rounding_mb, frees deferred across streams
(record_stream) and the torch version. Each expected number is worked out by hand from the rule, in the comments."""

from __future__ import annotations

import pytest

from peakledger.simulator.allocator import (
    AllocatorConfig,
    AllocatorConfigError,
    CachingAllocator,
    OutOfMemory,
    round_size,
)

MB = 1 << 20
EXPANDABLE = AllocatorConfig.parse("expandable_segments:True")


def events(model):
    return [(e.kind, e.addr, e.size) for e in model.events]


def kinds(model):
    return [(e.kind, e.size) for e in model.events]


def at(base):
    """A segment_address callback: each new segment at base, base + 1 GiB, ... (and records the sizes asked)."""
    asked = []

    def address(size, stream):
        asked.append(size)
        return base + (len(asked) - 1) * (1 << 30)
    address.asked = asked
    return address


# --- expandable segments

def test_expandable_address_space_and_page_sizes():
    # find_expandable_block: address space for capacity + capacity / 8 = 108 MiB, in whole pages: 6 large pages of
    # 20 MiB (120 MiB) or 54 small pages of 2 MiB (108 MiB). A 1000 B request (rounded 1024 B, small pool) maps one
    # 2 MiB page; 1 MiB + 1 B (rounded 1 MiB + 512 B, large pool) one 20 MiB page; 45 MiB on a fresh stream
    # ceil(45 / 20) = 3 pages = 60 MiB
    addr = at(1 << 40)
    m = CachingAllocator(EXPANDABLE, capacity=96 * MB, segment_address=addr)
    m.malloc(1000)
    m.malloc(MB + 1)
    m.malloc(45 * MB, stream=1)
    assert addr.asked == [108 * MB, 120 * MB, 120 * MB]
    assert kinds(m) == [("segment_map", 2 * MB), ("segment_map", 20 * MB), ("segment_map", 60 * MB)]
    assert m.reserved == 2 * MB + 20 * MB + 60 * MB
    # expandable_segments: every pool splits off a remainder >= 512 B: 1024 B, 1 MiB + 512 B and 45 MiB are allocated
    assert m.allocated == 1024 + MB + 512 + 45 * MB


def test_expandable_grows_from_the_free_tail():
    # 1 MiB + 1 B maps page 0 (20 MiB) and leaves 20 MiB - (1 MiB + 512 B) free at its end. 45 MiB fits nowhere;
    # find_expandable_block starts at that free tail (it lies just before the unmapped range): 45 MiB - 18.99 MiB
    # = 26.0 MiB more are needed, ceil(26.0 / 20) = 2 pages = 40 MiB mapped at 20 MiB; the block starts in the tail
    m = CachingAllocator(EXPANDABLE, capacity=200 * MB, segment_address=at(0))
    a = m.malloc(MB + 1)
    b = m.malloc(45 * MB)
    assert events(m) == [("segment_map", 0, 20 * MB), ("segment_map", 20 * MB, 40 * MB)]
    assert (a, b) == (0, MB + 512)
    # one mapped range: [a][b][free 60 MiB - (1 MiB + 512 B) - 45 MiB]
    assert m.layout() == {0: [(0, MB + 512, True), (MB + 512, 45 * MB, True),
                              (46 * MB + 512, 14 * MB - 512, False)]}


def test_expandable_reuses_freed_pages_where_segments_need_a_new_one():
    # default: two 30 MiB segments; both freed; 40 MiB fits neither, cudaMalloc of 40 MiB would make 100 MiB > 80,
    # so the cache is freed (both segments) and the retry allocates 40 MiB
    m = CachingAllocator(capacity=80 * MB)
    a, b = m.malloc(30 * MB), m.malloc(30 * MB)
    m.free(a)
    m.free(b)
    m.malloc(40 * MB)
    assert kinds(m) == [("segment_alloc", 30 * MB), ("segment_alloc", 30 * MB), ("segment_free", 30 * MB),
                        ("segment_free", 30 * MB), ("segment_alloc", 40 * MB)]
    # expandable: a maps 2 pages [0, 40) and takes [0, 30); b finds the free 10 MiB tail + unmapped space, maps one
    # page [40, 60) and takes [30, 60). Freed, a and b merge into one free block [0, 60) of the same segment, which
    # serves 40 MiB with no new mapping: reserved stays 60 MiB
    m = CachingAllocator(EXPANDABLE, capacity=80 * MB, segment_address=at(0))
    a, b = m.malloc(30 * MB), m.malloc(30 * MB)
    assert (a, b) == (0, 30 * MB)
    m.free(a)
    m.free(b)
    assert m.malloc(40 * MB) == 0
    assert events(m) == [("segment_map", 0, 40 * MB), ("segment_map", 40 * MB, 20 * MB)]
    assert m.reserved == 60 * MB and m.layout() == {0: [(0, 40 * MB, True), (40 * MB, 20 * MB, False)]}


def test_expandable_empty_cache_unmaps_whole_free_pages():
    # a = [0, 30), b = [30, 60) in pages 0-2 (60 MiB). a freed: empty_cache unmaps the whole pages inside [0, 30):
    # page 0 only; [20, 30) stays mapped and free (a partial page)
    m = CachingAllocator(EXPANDABLE, capacity=64 * MB, segment_address=at(0))
    a, b = m.malloc(30 * MB), m.malloc(30 * MB)
    m.free(a)
    m.events.clear()
    assert m.empty_cache() == 20 * MB
    assert events(m) == [("segment_unmap", 0, 20 * MB)]
    assert m.reserved == 40 * MB
    assert m.layout() == {20 * MB: [(20 * MB, 10 * MB, False), (30 * MB, 30 * MB, True)]}  # one range per mapping
    # b freed merges with [20, 30): [20, 60) = pages 1-2 unmapped; the address space is all unmapped again and the
    # segment is dropped
    m.free(b)
    m.events.clear()
    assert m.empty_cache() == 40 * MB
    assert events(m) == [("segment_unmap", 20 * MB, 40 * MB)]
    assert m.reserved == 0 and m.layout() == {} and not m.segments


def test_expandable_failed_map_unmaps_free_pages_of_another_stream():
    # capacity 60 MiB. Stream 0 maps 2 pages (40 MiB) for 30 MiB, then frees it. Stream 1 gets its own segment;
    # mapping 2 pages there would make 80 MiB > 60: release_cached_blocks unmaps stream 0's free pages (40 MiB,
    # its segment all unmapped is dropped) and the retry maps stream 1's pages
    m = CachingAllocator(EXPANDABLE, capacity=60 * MB, segment_address=at(0))
    m.free(m.malloc(30 * MB, stream=0))
    m.malloc(30 * MB, stream=1)
    assert events(m) == [("segment_map", 0, 40 * MB), ("segment_unmap", 0, 40 * MB),
                         ("segment_map", 1 << 30, 40 * MB)]
    assert m.reserved == 40 * MB and list(m.layout()) == [1 << 30]


def test_fragmentation_oom_default_served_by_expandable_segments():
    # capacity 64 MiB. 30 + 30 MiB allocated and freed: two cached 30 MiB segments. Two 16 MiB requests split them
    # (16 MiB + a 14 MiB free rest each: 14 > 1 MiB). A 20 MiB request: 32 MiB allocated + 20 = 52 MiB fits the
    # capacity, but no cached block holds 20 MiB, a new 20 MiB segment would make 80 MiB > 64, and no cached segment
    # is whole, so nothing can be released: OOM
    m = CachingAllocator(capacity=64 * MB)
    a, b = m.malloc(30 * MB), m.malloc(30 * MB)
    m.free(a)
    m.free(b)
    m.malloc(16 * MB)
    m.malloc(16 * MB)
    with pytest.raises(OutOfMemory):
        m.malloc(20 * MB)
    assert m.reserved == 60 * MB and m.allocated == 32 * MB
    # expandable: the two 30 MiB blocks lie side by side in one segment ([0, 30), [30, 60), 60 MiB mapped) and merge
    # when freed; 16, 16 and 20 MiB are cut from [0, 60) in turn: no new page, reserved 60 MiB <= 64
    m = CachingAllocator(EXPANDABLE, capacity=64 * MB, segment_address=at(0))
    a, b = m.malloc(30 * MB), m.malloc(30 * MB)
    m.free(a)
    m.free(b)
    assert [m.malloc(16 * MB), m.malloc(16 * MB), m.malloc(20 * MB)] == [0, 16 * MB, 32 * MB]
    assert m.reserved == 60 * MB and m.allocated == 52 * MB and m.ooms == 0


# --- roundup_power2_divisions

def test_roundup_power2_single_number():
    # 4 divisions per power of two: above 4 * 512 B = 2048 B, the next quarter step between two powers of two
    cfg = AllocatorConfig.parse("roundup_power2_divisions:4")
    expected = {
        1200: 1536,  # not > 2048 B: up to a 512 B multiple
        5000: 5120,  # 4096..8192 in steps of 1024: 5120
        MB + 1: MB + 256 * 1024,  # 1..2 MiB in steps of 256 KiB
        3 * MB: 3 * MB,  # 2..4 MiB in steps of 512 KiB: on a step already
        4 * MB: 4 * MB,  # a power of two stays
        5 * MB + 1: 6 * MB,  # 4..8 MiB in steps of 1 MiB
    }
    assert {n: round_size(n, cfg) for n in expected} == expected
    assert round_size(5000) == 5120 and round_size(MB + 1) == MB + 512  # no setting: 512 B multiples
    # the rounded size is what the allocator takes: 5 MiB + 1 B -> 6 MiB of a new 20 MiB segment (14 MiB split off)
    m = CachingAllocator(cfg)
    m.malloc(5 * MB + 1)
    assert kinds(m) == [("segment_alloc", 20 * MB)] and m.allocated == 6 * MB


def test_roundup_power2_list_and_version_difference():
    # [256:1,512:2,1024:4,>:8], intervals in MiB: index = log2(MiB); 256 -> 8 (and everything below it), 512 -> 9,
    # 1024 -> 10. torch 2.6 fills '>' from the last index given (10, overwriting 4 with 8); 2.11 from 11
    text = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    v26, v211 = AllocatorConfig.parse(text), AllocatorConfig.parse(text, torch_version="2.11")
    assert v26.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6
    assert v211.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    # 300 MiB (index 8: 1 division) -> a 512 B multiple; 600 MiB + 1 (index 9: 2) -> 512 MiB + 256 MiB steps -> 768 MiB
    for cfg in (v26, v211):
        assert round_size(300 * MB, cfg) == 300 * MB
        assert round_size(600 * MB + 1, cfg) == 768 * MB
    # 1536 MiB + 1 B (index 10): 2.6 has 8 divisions, steps of 128 MiB -> 1664 MiB; 2.11 has 4, steps of 256 MiB
    # -> 1792 MiB
    assert round_size(1536 * MB + 1, v26) == 1664 * MB
    assert round_size(1536 * MB + 1, v211) == 1792 * MB
    # the list form parses beside other settings (its commas are inside the brackets)
    # ([64:8,>:2]: 64 -> index 6, filled below with 8; 2.6's '>' starts at 6 and overwrites it with 2)
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[64:8,>:2], expandable_segments:True")
    assert cfg.expandable_segments and cfg.roundup_power2_divisions == (8,) * 6 + (2,) * 10


# --- garbage_collection_threshold

def test_garbage_collection_frees_old_cached_segments():
    # threshold 0.5 of 100 MiB allowed = 50 MiB. Ages count get_free_block calls of the large pool:
    #   a 30 MiB (call 1: new segment A), b 24 MiB (call 2: new segment B) -> reserved 54 MiB; both freed at count 2
    #   c 24 MiB (call 3) reuses B; freed at count 3
    #   d 40 MiB (call 4): no cached block fits; 54 > 50 so gc runs: target 4 MiB; ages A = 4 - 2 = 2, B = 4 - 3 = 1,
    #   average 1.5: A (2 >= 1.5) is freed (30 MiB >= 4, done), B stays; then a new 40 MiB segment: 64 MiB
    cfg = AllocatorConfig.parse("garbage_collection_threshold:0.5")
    m = CachingAllocator(cfg, capacity=100 * MB)
    a, b = m.malloc(30 * MB), m.malloc(24 * MB)
    m.free(a)
    m.free(b)
    m.free(m.malloc(24 * MB))
    m.malloc(40 * MB)
    assert kinds(m) == [("segment_alloc", 30 * MB), ("segment_alloc", 24 * MB), ("segment_free", 30 * MB),
                        ("segment_alloc", 40 * MB)]
    assert m.reserved == 64 * MB
    # without the threshold the same requests keep both cached segments: 54 + 40 = 94 MiB fits 100
    m = CachingAllocator(capacity=100 * MB)
    a, b = m.malloc(30 * MB), m.malloc(24 * MB)
    m.free(a)
    m.free(b)
    m.free(m.malloc(24 * MB))
    m.malloc(40 * MB)
    assert m.reserved == 94 * MB and len(m.events) == 3


def test_garbage_collection_needs_a_capacity():
    # torch runs garbage_collect_cached_blocks only under a memory fraction (allowed_memory_maximum)
    with pytest.raises(AllocatorConfigError, match="garbage_collection_threshold needs a capacity"):
        CachingAllocator(AllocatorConfig.parse("garbage_collection_threshold:0.6"))


# --- max_non_split_rounding_mb

def test_max_non_split_rounding():
    # max_split_size 32 MiB: a cached 60 MiB block serves an oversize 36 MiB request only if 60 < 36 + rounding.
    # Default rounding 20 MiB: 60 >= 56, a new 36 MiB segment. With 30 MiB: 60 < 66, the 60 MiB block is reused whole
    for text, segments in [("max_split_size_mb:32", [60 * MB, 36 * MB]),
                           ("max_split_size_mb:32,max_non_split_rounding_mb:30", [60 * MB])]:
        m = CachingAllocator(AllocatorConfig.parse(text))
        m.free(m.malloc(60 * MB))
        m.malloc(36 * MB)
        assert [e.size for e in m.events] == segments


# --- streams and deferred frees

def test_free_of_a_block_used_on_another_stream_waits_for_that_stream():
    m = CachingAllocator(segment_address=at(0))
    a = m.malloc(4096, stream=0)  # a 2 MiB small segment: [a 4096][free 2 MiB - 4096]
    m.record_stream(a, 1)
    m.free(a)
    # allocated drops at once; the block stays in use until stream 1 is done
    assert (m.allocated, m.pending_free, m.requested) == (0, 4096, 4096)
    b = m.malloc(4096, stream=0)  # a is not reusable yet: b comes from the free rest
    assert b == 4096 and m.layout()[0][0] == (0, 4096, True)
    m.synchronize(1)
    assert m.pending_free == 0 and m.layout()[0][0] == (0, 4096, False)
    assert m.malloc(4096, stream=0) == a  # best fit: the freed 4096 B block before the bigger rest
    assert len(m.events) == 1
    # a use recorded on the block's own stream is ignored: the free is immediate
    c = m.malloc(4096)
    m.record_stream(c, 0)
    m.free(c)
    assert m.pending_free == 0


def test_empty_cache_waits_for_every_stream_then_releases():
    # release_cached_blocks synchronizes all outstanding events first: the pending block is freed, merges with the
    # rest of its segment, and the whole 2 MiB segment is released
    m = CachingAllocator()
    a = m.malloc(4096)
    m.record_stream(a, 1)
    m.record_stream(a, 2)
    m.free(a)
    m.synchronize(1)  # stream 2 still holds it
    assert m.pending_free == 4096
    assert m.empty_cache() == 2 * MB
    assert kinds(m) == [("segment_alloc", 2 * MB), ("segment_free", 2 * MB)] and m.pending_free == 0


def test_streams_have_their_own_expandable_segments():
    # one expandable segment per (stream, pool): two streams map a 20 MiB page each, at their own addresses
    m = CachingAllocator(EXPANDABLE, capacity=64 * MB, segment_address=at(0))
    m.free(m.malloc(12 * MB, stream=0))
    m.malloc(12 * MB, stream=1)  # stream 0's free 20 MiB is not used by stream 1
    assert events(m) == [("segment_map", 0, 20 * MB), ("segment_map", 1 << 30, 20 * MB)]


# --- versions and settings

def test_versions():
    assert AllocatorConfig.parse("", torch_version="2.6.0") == AllocatorConfig()
    assert AllocatorConfig.parse("", torch_version="2.11").torch_version == "2.11"
    with pytest.raises(AllocatorConfigError, match=r"torch_version '2\.8'.*allowed: 2\.6, 2\.11"):
        AllocatorConfig.parse("", torch_version="2.8")
    # parseMaxSplitSize / parseMaxNonSplitRoundingSize: 2.6 wants > 20 MiB, 2.11 >= 20
    for key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        with pytest.raises(AllocatorConfigError, match=f"{key} must be an integer number of MiB > 20"):
            AllocatorConfig.parse(f"{key}:20")
    assert AllocatorConfig.parse("max_split_size_mb:20", torch_version="2.11").max_split_size == 20 * MB
    assert AllocatorConfig.parse("max_non_split_rounding_mb:20", "2.11").max_non_split_rounding == 20 * MB
    with pytest.raises(AllocatorConfigError, match=">= 20"):
        AllocatorConfig.parse("max_split_size_mb:19", torch_version="2.11")
    # keys only 2.11 knows
    with pytest.raises(AllocatorConfigError, match="unknown allocator setting 'graph_capture_record_stream_reuse'"):
        AllocatorConfig.parse("graph_capture_record_stream_reuse:True")
    assert AllocatorConfig.parse("graph_capture_record_stream_reuse:True", "2.11") == AllocatorConfig(
        torch_version="2.11")
    for text in ("per_process_memory_fraction:0.5", "large_segment_size_mb:40"):
        with pytest.raises(AllocatorConfigError, match="unknown allocator setting"):
            AllocatorConfig.parse(text)
        with pytest.raises(AllocatorConfigError, match="not modelled"):
            AllocatorConfig.parse(text, torch_version="2.11")


def test_settings_accepted_and_ignored():
    # keys of 2.6 that do not touch the device blocks: validated, no effect
    cfg = AllocatorConfig.parse("pinned_use_background_threads:True, release_lock_on_cudamalloc:False,"
                                "pinned_num_register_threads:8,backend:native,max_non_split_rounding_mb:64")
    assert cfg == AllocatorConfig(max_non_split_rounding=64 * MB)


@pytest.mark.parametrize("text,words", [
    ("garbage_collection_threshold:1.2", r"garbage_collection_threshold must be a number in \(0.0, 1.0\)"),
    ("garbage_collection_threshold:often", "garbage_collection_threshold must be"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions must be a power of 2"),
    ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions: divisions must be a power of 2 or 0"),
    ("roundup_power2_divisions:[300:2]", "roundup_power2_divisions: intervals must be powers of 2"),
    ("roundup_power2_divisions:[256:2", "roundup_power2_divisions: expected a closing"),
    ("expandable_segments:yes", "expandable_segments must be True or False"),
    ("backend:magic", "backend must be native or cudaMallocAsync"),
    ("backend:cudaMallocAsync", "not modelled: backend:cudaMallocAsync"),
    ("expandable_segments:True,max_split_size_mb:64", "not modelled: expandable_segments:True together with"),
    ("pinned_num_register_threads:3", "pinned_num_register_threads must be a power of 2 up to 128"),
    ("max_split_size_mb", "'max_split_size_mb' needs a value"),
    ("max_split_size_mb:64 expandable_segments:True", "max_split_size_mb must be an integer"),
    ("colour:blue", "unknown allocator setting 'colour'"),
])
def test_bad_settings(text, words):
    with pytest.raises(AllocatorConfigError, match=words) as err:
        AllocatorConfig.parse(text)
    assert str(err.value).startswith("alloc_conf: ")


def _check_invariants(m):
    """Blocks tile every segment in address order; free neighbours of one mapping state are merged; the indexes
    hold exactly the free mapped and the unmapped blocks; reserved = whole segments + mapped pages."""
    reserved = allocated = 0
    free, unmapped = set(), set()
    for addr, seg in m.segments.items():
        pos = addr
        blocks = seg.blocks()
        for b in blocks:
            assert b.addr == pos and m.blocks[b.addr] is b and b.segment is seg
            pos += b.size
            allocated += b.size if b.allocated else 0
            reserved += b.size if seg.expandable and b.mapped else 0
            if b.mapped and b.free:
                free.add((seg.stream, b.size, b.addr))
            if not b.mapped:
                unmapped.add((seg.stream, b.addr))
                assert (b.addr - addr) % seg.page == 0 and b.size % seg.page == 0
        assert pos == addr + seg.size
        assert not any(x.free and y.free and x.mapped == y.mapped for x, y in zip(blocks, blocks[1:]))
        reserved += 0 if seg.expandable else seg.size
    assert (reserved, allocated) == (m.reserved, m.allocated)
    assert free == set(m._free["small"]) | set(m._free["large"])
    assert unmapped == set(m._unmapped["small"]) | set(m._unmapped["large"])
    assert m.capacity is None or m.reserved <= m.capacity


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:True,roundup_power2_divisions:4",
                                  "garbage_collection_threshold:0.6", "expandable_segments:True,"
                                  "garbage_collection_threshold:0.6"])
def test_random_requests_keep_the_invariants(conf):
    # seeded random mallocs (three size ranges, two streams), frees, record_stream, synchronize and empty_cache under
    # a 300 MiB capacity; after everything is freed, empty_cache gives every byte back
    import random
    for seed in range(6):
        r = random.Random(seed)
        m = CachingAllocator(AllocatorConfig.parse(conf), capacity=300 * MB)
        live = []
        for _ in range(150):
            op = r.random()
            if op < 0.5 or not live:
                size = r.choice([r.randint(1, MB), r.randint(MB, 12 * MB), r.randint(10 * MB, 60 * MB)])
                try:
                    live.append(m.malloc(size, r.choice([0, 0, 1])))
                except OutOfMemory:
                    pass
                if live and r.random() < 0.2:
                    m.record_stream(r.choice(live), r.choice([0, 1, 2]))
            elif op < 0.9:
                m.free(live.pop(r.randrange(len(live))))
            elif op < 0.95:
                m.synchronize(r.choice([None, 1, 2]))
            else:
                m.empty_cache()
            _check_invariants(m)
        for a in live:
            m.free(a)
        m.empty_cache()
        _check_invariants(m)
        assert m.reserved == 0 and not m.segments


@pytest.mark.parametrize("capacity", [0, 1 * MB, 3 * MB])
def test_expandable_request_larger_than_the_address_space_is_an_oom(capacity):
    """A capacity (a budget under the CUDA context) whose 1 1/8 address space cannot hold one request: torch's
    find_expandable_block finds no room and the mapping fails, an OOM (it read past the segment's end before)."""
    m = CachingAllocator(EXPANDABLE, capacity=capacity)
    with pytest.raises(OutOfMemory):
        m.malloc(4 * MB, 0)
    assert m.reserved <= capacity  # pages mapped before the failed mapping stay, never past the capacity
