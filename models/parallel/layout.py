"""The layouts, pure: how a tensor is split over N ranks (dim-0 chunks, flat partitions, greedy
assignment), DeepSpeed's and DDP's constants, and which unit (FSDP2 / ZeRO-3 module) a parameter belongs to."""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass

DS_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: flat buffers padded to a multiple of 2N
DS_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed stage 3 sub_group_size (elements), its default
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
UNIT_PATTERN = re.compile(r"^(transformer\.h\.\d+|model\.layers\.\d+|layers\.\d+)\.")
ROOT = "root"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- layouts (pure) ----------------------------------------------------------------------------------

def dim0_shard(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, int]:
    """FSDP2: (padded elements stored on every rank, elements of this rank's unpadded local shard).

    torch.chunk on dim 0: every rank stores ceil(dim0 / N) rows (padding included); rank r's local
    shard holds the rows that exist, which can be fewer (or none) on the last ranks."""
    rows = shape[0] if shape else 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    chunk = ceil_div(rows, world_size)
    local_rows = max(0, min(chunk, rows - rank * chunk))
    return chunk * rest, local_rows * rest


def flat_partition(total_numel: int, world_size: int, alignment: int = DS_ALIGNMENT) -> tuple[int, int]:
    """DeepSpeed stages 1-2: (padded flat numel, numel of each rank's partition)."""
    unit = alignment * world_size
    padded = ceil_div(total_numel, unit) * unit
    return padded, padded // world_size


def dim0_ranges(shape: tuple[int, ...], world_size: int) -> list[tuple[int, int]]:
    """FSDP2: the ranks of `dim0_shard` by their local shard, as (first rank, local elements) of consecutive
    ranges, ascending from rank 0 (each runs to the next one's first rank, the last to world_size - 1):
    the full chunks, the one partial chunk (when dim0 is not a multiple of the chunk), the empty ones. At
    most three ranges, whatever the world size; `dim0_shard(shape, N, r)[1]` is the local elements of the
    range holding r."""
    rows = shape[0] if shape else 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    chunk = ceil_div(rows, world_size)
    if not chunk:  # no rows at all
        return [(0, 0)]
    full, left = divmod(rows, chunk)  # ranks 0..full-1 hold `chunk` rows; rank `full` the `left` rows, if any
    out = [(0, chunk * rest)] if full else []
    if left:
        out.append((full, left * rest))
    end = full + (1 if left else 0)
    if end < world_size:
        out.append((end, 0))
    return out


def greedy_owners(numels: list[tuple[str, int]], world_size: int) -> list[list[str]]:
    """`greedy_partition` without the ranks that own nothing: the parameters of ranks 0..k-1, where every
    rank from k on owns none (k <= min(world_size, parameters)). A heap of the ranks given something so far,
    against the lowest rank not yet given anything (its size 0): O(P log P) for P parameters, any world."""
    heap: list[tuple[int, int]] = []  # (elements so far, rank) of ranks 0..len(owned)-1
    owned: list[list[str]] = []
    for name, numel in sorted(numels, key=lambda item: -item[1]):
        if len(owned) < world_size and not (heap and heap[0][0] == 0):
            rank, size = len(owned), 0  # the lowest rank with nothing yet: fewest elements, lowest on ties
            owned.append([])
        else:
            size, rank = heapq.heappop(heap)
        owned[rank].append(name)
        heapq.heappush(heap, (size + numel, rank))
    return owned


def greedy_partition(numels: list[tuple[str, int]], world_size: int) -> list[list[str]]:
    """torch ZeroRedundancyOptimizer: parameters sorted by size (largest first, stable), each to the rank
    with the fewest elements so far (the lowest rank on ties). One list per rank (`greedy_owners` leaves
    out the ranks that own nothing)."""
    owned = greedy_owners(numels, world_size)
    return owned + [[] for _ in range(world_size - len(owned))]


def unit_of(name: str, units: set[str]) -> str:
    """The FSDP unit a parameter or op belongs to: the transformer block / MLP Linear it sits in, else root."""
    m = UNIT_PATTERN.match(name + ".")
    if m and m.group(1) in units:
        return m.group(1)
    parts = name.split(".")
    for k in range(1, len(parts)):  # a traced tape's layers (`Tape.layers`): any module path
        if ".".join(parts[:k]) in units:
            return ".".join(parts[:k])
    return ROOT


def sub_groups(numels: list[int], size: int = DS_SUB_GROUP_SIZE) -> list[int]:
    """DeepSpeed stage 3: partition numels grouped in order into sub-groups of at most `size` elements
    (a larger tensor is a sub-group of its own); the numel of each sub-group."""
    groups: list[int] = []
    current = 0
    for n in numels:
        if current and current + n > size:
            groups.append(current)
            current = 0
        current += n
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class OptimTensor:
    """One tensor the optimizer updates on this rank: a parameter, its shard, or a flat partition."""

    name: str
    numel: int
    shape: tuple[int, ...]


def own_dtype(tape, name: str) -> str | None:
    """A parameter's own dtype where the tape gives one (models/lora.py `LoraTape`: fp32 adapters under pure bf16,
    4-bit packed weights), else None (the setup's parameter dtype)."""
    return getattr(tape, "param_dtypes", {}).get(name)


# -- engines ------------------------------------------------------------------------------------------
