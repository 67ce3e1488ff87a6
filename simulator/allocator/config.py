"""The allocator settings (PYTORCH_CUDA_ALLOC_CONF) and the size rules that depend on them.

Parsing follows torch's own parser for the release asked for: c10/cuda/CUDAAllocatorConfig.cpp `parseArgs` in torch
2.6, c10/core/AllocatorConfig.cpp `AcceleratorAllocatorConfig::parseArgs` plus CUDAAllocatorConfig.cpp from 2.11 on
(the keys of each release are those its headers declare). What differs between releases is a field of the
release's rule set (simulator/torch_rules: its keys, the 20 MiB bound, the '>' fill); each rule says where.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..safe_io import InputError
from ..torch_rules import TORCH_VERSIONS, TorchRules, TorchVersionError, rules_for

KB, MB = 1 << 10, 1 << 20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MB  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MB  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks (and the small pool's page)
K_LARGE_BUFFER = 20 * MB  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks (and the large page)
K_MIN_LARGE_ALLOC = 10 * MB  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 * MB  # kRoundLarge: round up large allocations to 2 MiB
K_ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one entry per power of two
SMALL, LARGE = "small", "large"

# the keys whose value is True or False (toBool / "Expected a single True/False argument"), in every release
_BOOL_KEYS = frozenset({"expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                        "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                        "pinned_use_background_threads", "graph_capture_record_stream_reuse", "pinned_free_catch_all",
                        "throw_on_cudamalloc_oom"})


class AllocatorConfigError(InputError):
    def __init__(self, message: str) -> None:
        super().__init__("alloc_conf", message)


def normalize_torch_version(text: str | None) -> str:
    """"2.6", "2.6.0", "2.11.0+cu128" -> "2.6" / "2.11"; a version whose rules are not modelled is refused."""
    try:
        return rules_for(text).version
    except TorchVersionError:
        raise AllocatorConfigError(f"torch_version {text!r} is not modelled; allowed: {', '.join(TORCH_VERSIONS)} "
                                   "(major.minor, a patch level is ignored)") from None


def _tokens(text: str) -> list[str]:
    """ConfigTokenizer / lexArgs: ',', ':', '[' and ']' are tokens of their own, spaces are dropped."""
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _int(key: str, value: str, allowed: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise AllocatorConfigError(f"{key} must be {allowed}, got {value!r}") from None


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):  # toBool / "Expected a single True/False argument"
        raise AllocatorConfigError(f"{key} must be True or False, got {value!r}")
    return value == "True"


def _mb_at_least_20(key: str, value: str, rules: TorchRules) -> int:
    # parseMaxSplitSize / parseMaxNonSplitRoundingSize: 2.6 wants > kLargeBuffer/MiB (20), 2.11 on >= 20
    strict = rules.max_split_strict
    allowed = f"an integer number of MiB {'>' if strict else '>='} {K_LARGE_BUFFER // MB} (torch {rules.version})"
    mb = _int(key, value, allowed)
    if mb < K_LARGE_BUFFER // MB or (strict and mb == K_LARGE_BUFFER // MB):
        raise AllocatorConfigError(f"{key} must be {allowed}, got {mb}")
    if mb * MB >= 1 << 64:  # torch holds it in a size_t: no byte count of that size exists
        raise AllocatorConfigError(f"{key} must be {allowed} and below 2^64 bytes, got {len(value)} digits")
    return mb * MB


def _roundup_list(toks: list[str], i: int, rules: TorchRules) -> tuple[list[int], int]:
    """parseRoundUpPower2Divisions, list form `[256:1,512:2,>:8]` (interval starts in MiB, powers of two): the first
    entry also fills every interval below it; '>' fills the rest, from the last given interval in 2.6 (overwriting
    it) and from the one after it from 2.11 on (the fill starts at last_index + 1). Returns (table, index of ']')."""
    table = [0] * K_ROUNDUP_INTERVALS
    first, last = True, 0
    allowed = "[INTERVAL_MB:DIVISIONS,...,>:DIVISIONS] with power-of-two intervals and divisions a power of two or 0"
    i += 1
    while i < len(toks) and toks[i] != "]":
        bound = toks[i]
        if i + 2 >= len(toks) or toks[i + 1] != ":":
            raise AllocatorConfigError(f"roundup_power2_divisions must be {allowed}")
        div = _int("roundup_power2_divisions", toks[i + 2], allowed)
        if div != 0 and not _pow2(div):
            raise AllocatorConfigError(f"roundup_power2_divisions: divisions must be a power of 2 or 0, got {div}")
        if bound == ">":
            start = last + 1 if rules.roundup_fill_after_last else last
            table[start:] = [div] * (K_ROUNDUP_INTERVALS - start)
        else:
            mb = _int("roundup_power2_divisions", bound, allowed)
            if not _pow2(mb):
                raise AllocatorConfigError(f"roundup_power2_divisions: intervals must be powers of 2 (MiB), got {mb}")
            index = min(mb.bit_length() - 1, K_ROUNDUP_INTERVALS - 1)
            if first:
                table[:index] = [div] * index
                first = False
            table[index] = div
            last = index
        i += 3
        if i < len(toks) and toks[i] == ",":
            i += 1
    if i >= len(toks):
        raise AllocatorConfigError("roundup_power2_divisions: expected a closing ']'")
    return table, i


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings, in PYTORCH_CUDA_ALLOC_CONF terms. max_split_size None = unlimited (torch's default);
    roundup_power2_divisions: () = no power-of-two rounding, else 16 entries (1 MiB, 2 MiB, ... >= 32 GiB);
    garbage_collection_threshold 0 = off."""

    max_split_size: int | None = None
    expandable_segments: bool = False
    roundup_power2_divisions: tuple[int, ...] = ()
    garbage_collection_threshold: float = 0.0
    max_non_split_rounding: int = K_LARGE_BUFFER  # max_non_split_rounding_size: kLargeBuffer by default
    torch_version: str = "2.6"

    def divisions(self, size: int) -> int:
        """roundup_power2_divisions(size): the entry of size's power-of-two interval (below 1 MiB: the first)."""
        if not self.roundup_power2_divisions:
            return 0
        index = min(max(size.bit_length() - 1 - 20, 0), K_ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    @classmethod
    def parse(cls, text: str | None, torch_version: str = "2.6") -> "AllocatorConfig":
        """Parse torch's syntax, "key:value,key:[a:b,...]" (parseArgs of `torch_version`); refuse what is not
        modelled."""
        version = normalize_torch_version(torch_version)
        rules = rules_for(version)
        keys, not_modelled = rules.alloc_keys, rules.not_modelled()
        toks = _tokens(text or "")
        values: dict = {}
        unmodelled: list[str] = []
        i = 0
        while i < len(toks):
            key = toks[i]
            if key == ",":  # an empty item between commas
                i += 1
                continue
            if key not in keys:
                raise AllocatorConfigError(f"unknown allocator setting {key!r}; torch {version} accepts "
                                           f"{', '.join(sorted(keys))}")
            if i + 2 >= len(toks) or toks[i + 1] != ":" or toks[i + 2] in ",:]":
                raise AllocatorConfigError(f"allocator setting {key!r} needs a value ({key}:VALUE)")
            value = toks[i + 2]
            i += 2
            if key == "max_split_size_mb" or key == "max_non_split_rounding_mb":
                values[key] = _mb_at_least_20(key, value, rules)
            elif key == "garbage_collection_threshold":  # parseGarbageCollectionThreshold: in (0.0, 1.0)
                try:
                    t = float(value)
                except ValueError:
                    t = -1.0
                if not 0.0 < t < 1.0:
                    raise AllocatorConfigError(f"garbage_collection_threshold must be a number in (0.0, 1.0), "
                                               f"got {value!r}")
                values[key] = t
            elif key == "roundup_power2_divisions":
                if value == "[":
                    table, i = _roundup_list(toks, i, rules)
                else:  # the single-number form (kept for backwards compatibility): one power of 2 for all intervals
                    n = _int(key, value, "a power of 2 or a [INTERVAL_MB:DIVISIONS,...] list")
                    if not _pow2(n):
                        raise AllocatorConfigError(f"roundup_power2_divisions must be a power of 2, got {n}")
                    table = [n] * K_ROUNDUP_INTERVALS
                values[key] = tuple(table) if any(table) else ()
            elif key == "expandable_segments":
                values[key] = _bool(key, value)
            elif key == "backend":  # parseAllocatorConfig: native or cudaMallocAsync
                if value not in ("native", "cudaMallocAsync"):
                    raise AllocatorConfigError(f"backend must be native or cudaMallocAsync, got {value!r}")
                if value != "native":
                    unmodelled.append(f"backend:{value}")
            elif key == "pinned_num_register_threads":  # a power of 2, at most pinned_max_register_threads (128)
                n = _int(key, value, "a power of 2 up to 128")
                if not _pow2(n) or n > 128:
                    raise AllocatorConfigError(f"pinned_num_register_threads must be a power of 2 up to 128, got {n}")
            elif key == "pinned_reserve_segment_size_mb":
                if _int(key, value, "an integer number of MiB > 0") <= 0:
                    raise AllocatorConfigError(f"pinned_reserve_segment_size_mb must be > 0, got {value}")
            elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):  # 2.13: std::stoull
                _int(key, value, "an integer number of MiB")
            elif key in rules.alloc_no_effect:
                _bool(key, value)
            elif key in _BOOL_KEYS and not _bool(key, value):  # False: torch's default, nothing to model
                pass
            else:
                unmodelled.append(f"{key}:{value} ({not_modelled[key]})")
            i += 1
            if i < len(toks):
                if toks[i] != ",":
                    raise AllocatorConfigError(f"expected ',' after the value of {key!r}, got {toks[i]!r}")
                i += 1
        if values.get("expandable_segments") and "max_split_size_mb" in values:
            unmodelled.append("expandable_segments:True together with max_split_size_mb (torch 2.6's "
                              "release_available_cached_blocks would cudaFree an expandable block)")
        if unmodelled:
            raise AllocatorConfigError("allocator settings not modelled: " + "; ".join(unmodelled) + " (modelled: "
                                       "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, "
                                       "garbage_collection_threshold, expandable_segments)")
        return cls(max_split_size=values.get("max_split_size_mb"),
                   expandable_segments=values.get("expandable_segments", False),
                   roundup_power2_divisions=values.get("roundup_power2_divisions", ()),
                   garbage_collection_threshold=values.get("garbage_collection_threshold", 0.0),
                   max_non_split_rounding=values.get("max_non_split_rounding_mb", K_LARGE_BUFFER),
                   torch_version=version)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: up to the next of `divisions` equal steps between two powers of two."""
    if _pow2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """round_size: below 512 B 512 B; with roundup_power2_divisions d > 1 for size's interval and size > 512*d, the
    next power-of-two division; else up to a multiple of 512 B."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions(size) if config is not None else 0
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def pool_of(rounded: int) -> str:
    """get_pool: small if the rounded size is <= kSmallSize."""
    return SMALL if rounded <= K_SMALL_SIZE else LARGE


def allocation_size(rounded: int) -> int:
    """get_allocation_size: the size of a new segment for a request."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE)
