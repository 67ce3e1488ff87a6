"""A model of torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), pure and deterministic, for torch
each modelled release (simulator/torch_rules; `AllocatorConfig.parse(text, torch_version=...)`).

How the modules compose:

- config.py: the settings (AllocatorConfig.parse, torch's PYTORCH_CUDA_ALLOC_CONF parser per version) and the size
  rules that depend on them: round_size (512 B multiples, or roundup_power2_divisions), pool_of, allocation_size.
- blocks.py: Block, Segment, SegmentEvent, OutOfMemory: the bookkeeping.
- core.py: CachingAllocator, torch's DeviceCachingAllocator: malloc (get_free_block best fit per stream and pool,
  should_split, alloc_block, garbage_collect_cached_blocks, release_available_cached_blocks and release_cached_blocks
  each followed by a retry), free / free_block with try_merge_blocks, record_stream and the events that defer a free
  across streams (insert_events, process_events, synchronize_and_free_events), empty_cache, layout.
- expandable.py: expandable segments (find_expandable_block, map_block, unmap_block), mixed into CachingAllocator.

Each rule is cited, where it is coded, to the torch function it comes from. What differs between the versions is
the settings parser (config.py): 2.6 takes max_split_size_mb and max_non_split_rounding_mb > 20, 2.11 >= 20; in the
`[...,>:N]` form of roundup_power2_divisions 2.6's '>' also overwrites the last interval given, 2.11's starts after
it; 2.11 accepts more keys. The allocation rules the model covers read the same in both.

Not modelled (refused when asked for): backend:cudaMallocAsync, large_segment_size_mb and per_process_memory_fraction
(2.11; give the allowed bytes as the capacity), expandable_segments together with max_split_size_mb, CUDA graphs and
private pools. Settings that do not touch the device blocks (pinned memory, the lock) are accepted and ignored.

The model never invents addresses: a new segment's address comes from the caller (`segment_address`), which in a
replay of a snapshot is the address of the trace's segment_alloc and in a simulation a deterministic counter.
"""

from .blocks import Block, OutOfMemory, Segment, SegmentEvent
from .config import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_ROUNDUP_INTERVALS,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    KB,
    LARGE,
    MB,
    SMALL,
    TORCH_VERSIONS,
    AllocatorConfig,
    AllocatorConfigError,
    allocation_size,
    normalize_torch_version,
    pool_of,
    round_size,
)
from .core import CachingAllocator

__all__ = ["AllocatorConfig", "AllocatorConfigError", "Block", "CachingAllocator", "K_LARGE_BUFFER", "K_MIN_BLOCK_SIZE",
           "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE", "K_ROUNDUP_INTERVALS", "K_SMALL_BUFFER", "K_SMALL_SIZE", "KB", "LARGE",
           "MB", "OutOfMemory", "SMALL", "Segment", "SegmentEvent", "TORCH_VERSIONS", "allocation_size",
           "normalize_torch_version", "pool_of", "round_size"]
