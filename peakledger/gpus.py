"""How many GPUs: the smallest number of GPUs over which a scenario fits a card, for each way of spreading it.

A layout is a way to put the same training step on more GPUs, each one a rank holding less:

- FSDP2 (torch.distributed.fsdp fully_shard): parameters, gradients and optimizer states sharded over the
  data-parallel ranks, each unit's parameters all-gathered around its forward and backward;
- ZeRO-3 (DeepSpeed stage 3): the same sharding, DeepSpeed's buckets and prefetch;
- TP (DTensor tensor parallelism within one node, at most `NODE_GPUS` GPUs): weights and the activations between
  linears split over the ranks, each a divisor of the attention and key/value heads.

Each keeps the scenario's own model-parallel degrees (tp x pp x cp) and its micro-batch per GPU: with more
data-parallel ranks each step trains on that many more samples (the same global batch needs a smaller
accumulation, which does not change a rank's memory). The answer N is checked, not estimated: the scenario is
simulated at N, where it fits, and at the candidate below N, where it does not; the search gallops (1, 2, 4, ...)
to a fitting size, then halves the gap, so it simulates O(log N) sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from .models.config import ConfigError
from .models.families import family_of
from .models.names import did_you_mean
from .scenario import Scenario

NODE_GPUS = 8  # tensor parallelism stays within one node's NVLink domain (8 GPUs per HGX / DGX node)
GPU_LIMIT = 4096  # the largest world size searched


class Verdict(Protocol):
    fits: bool


V = TypeVar("V", bound=Verdict)


@dataclass(frozen=True)
class Layout:
    """One way to spread the step over more GPUs: its name, the knobs for `n` GPUs in all, and the sizes it can
    take (ascending; the scenario's own size first)."""

    name: str
    key: str  # the name in --json and on the command line
    changes: Callable[[Scenario, int], dict]
    sizes: Callable[[Scenario, int], list[int]]  # (scenario, limit) -> candidate GPU counts, ascending
    note: str


def _model_parallel(scenario: Scenario) -> int:
    m = scenario.setup.mesh
    return m.tp * m.pp * m.cp


def _dp_sizes(scenario: Scenario, limit: int) -> list[int]:
    m = _model_parallel(scenario)
    return [k * m for k in range(1, limit // m + 1)]


def _fsdp2(scenario: Scenario, n: int) -> dict:
    if n == scenario.setup.mesh.world_size:
        return {}
    return {"world_size": n, "dp_engine": "fsdp2"}


def _zero3(scenario: Scenario, n: int) -> dict:
    if n == scenario.setup.mesh.world_size:
        return {}
    return {"world_size": n, "dp_engine": "deepspeed", "zero_stage": 3}


def _tp_sizes(scenario: Scenario, limit: int) -> list[int]:
    model, mesh = scenario.model, scenario.setup.mesh
    if not family_of(model).transformer:
        return []
    heads = (model.n_head, model.kv_heads)
    return [mesh.world_size * k for k in range(1, NODE_GPUS // mesh.tp + 1)
            if all(h % (mesh.tp * k) == 0 for h in heads) and mesh.world_size * k <= limit]


def _tp(scenario: Scenario, n: int) -> dict:
    mesh = scenario.setup.mesh
    k = n // mesh.world_size
    return {} if k == 1 else {"tp": mesh.tp * k, "world_size": n}


FSDP2 = Layout("FSDP2", "fsdp2", _fsdp2, _dp_sizes,
               "parameters, gradients and optimizer states sharded over the GPUs; each block's parameters gathered "
               "around its forward and backward")
ZERO3 = Layout("ZeRO-3", "zero3", _zero3, _dp_sizes,
               "DeepSpeed stage 3: the same sharding, with DeepSpeed's buckets and prefetch")
TP = Layout("TP", "tp", _tp, _tp_sizes,
            f"tensor parallelism within a node (at most {NODE_GPUS} GPUs, a divisor of the heads): weights and the "
            "activations between linears split")
LAYOUTS: tuple[Layout, ...] = (FSDP2, ZERO3, TP)
LAYOUT_ALIASES = {"fsdp": "fsdp2", "zero": "zero3", "deepspeed": "zero3", "zero-3": "zero3", "tensor": "tp"}


@dataclass(frozen=True)
class Count(Generic[V]):
    """The smallest GPU count for one layout: `n` with the verdict there, and the verdict at the candidate size below
    it (None when `n` is the scenario's own size). When none up to `limit` fits, `n` is None and `below` is the
    verdict at the largest size tried."""

    layout: Layout
    n: int | None
    at: V | None
    below: V | None
    below_n: int | None
    limit: int
    error: str | None = None  # the layout is refused for this scenario (its ConfigError), or has no size

    def changes(self, scenario: Scenario) -> dict:
        return self.layout.changes(scenario, self.n) if self.n is not None else {}


def min_gpus(scenario: Scenario, layout: Layout, judge: Callable[[Scenario], V], limit: int = GPU_LIMIT,
             known: dict[int, V] | None = None) -> Count[V]:
    """The smallest of `layout`'s sizes (up to `limit` GPUs) at which `judge(scenario at that size).fits`, and the
    verdicts at it and at the size below. A size the setup refuses counts as not fitting; a layout refused at
    every size it tries says so in `error`. `known`: verdicts the caller has already (GPU count -> verdict: the
    scenario's own run), not judged again."""
    sizes = layout.sizes(scenario, limit)
    if not sizes:
        return Count(layout, None, None, None, None, limit, error="no size of this layout applies to the model")
    seen: dict[int, V | None] = {i: known[n] for i, n in enumerate(sizes) if known and n in known}
    refusal: list[str] = []

    def verdict(i: int) -> V | None:
        if i not in seen:
            try:
                seen[i] = judge(scenario.with_changes(**layout.changes(scenario, sizes[i])))
            except ConfigError as e:
                refusal.append(f"{e.field}: {e}")
                seen[i] = None
        return seen[i]

    def fits(i: int) -> bool:
        v = verdict(i)
        return v is not None and v.fits

    lo, hi = -1, 0  # sizes[lo] does not fit (-1: below the first), sizes[hi] is tried next
    while not fits(hi):
        lo = hi
        if hi == len(sizes) - 1:
            error = refusal[0] if refusal and all(v is None for v in seen.values()) else None
            return Count(layout, None, None, verdict(hi), sizes[hi], limit, error=error)
        hi = min(2 * hi + 1, len(sizes) - 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return Count(layout, sizes[hi], verdict(hi), verdict(lo) if lo >= 0 else None,
                 sizes[lo] if lo >= 0 else None, limit)


def layouts_by_key(keys: Sequence[str] | None) -> tuple[Layout, ...]:
    """The layouts named (all when `keys` is empty); ConfigError naming `layouts` for an unknown one."""
    if not keys:
        return LAYOUTS
    known = {lay.key: lay for lay in LAYOUTS}
    for key in keys:
        if key not in known:
            raise ConfigError("layouts", f"{key!r} is not a layout; allowed: {', '.join(known)}"
                                         + did_you_mean(key, known, LAYOUT_ALIASES))
    return tuple(known[k] for k in dict.fromkeys(keys))


__all__ = ["Layout", "LAYOUTS", "FSDP2", "ZERO3", "TP", "Count", "min_gpus", "layouts_by_key", "NODE_GPUS",
           "GPU_LIMIT"]
