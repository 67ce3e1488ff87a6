"""Host memory: each rank's host peak (total, and how much of it is pinned), and the node's verdict.

What a rank holds on the host is its Pool.HOST blocks (optimizer-state offload buffers, save_on_cpu copies,
checkpoint staging, a loaded state dict, whatever a technique puts there); `Block.pinned` says which are
page-locked (simulator/events.py). The ranks of one node share its host, so the node is judged:

- host need per node = sum over the node's ranks of each rank's host peak + PROCESS_BASELINE per rank. The sum
  of the peaks is conservative: the ranks' peaks need not fall at the same moment (in data parallelism they
  nearly do: the same program on every rank);
- pinned need per node = sum over the node's ranks of each rank's pinned peak (its own highest pinned bytes);
- it fits when host need <= host memory and pinned need <= the pinned limit.

The limits: `host_memory` per node (--host-memory; by default the device profile's typical node, models/devices.py
NODE_HOSTS, DGX H100: 2 TiB, else not judged), `pinned_limit` per node (--pinned-limit; by default
PINNED_SHARE of the host memory). The CUDA driver pins with its own calls (cuMemHostAlloc / cuMemHostRegister),
not mlock, so RLIMIT_MEMLOCK (`ulimit -l`) does not bound it; what bounds it is RAM, and the driver API's own
warning: "Page-locking excessive amounts of memory may degrade system performance, since it reduces the amount
of memory available to the system for paging" (CUDA Driver API, cuMemHostAlloc). Half of RAM is this module's
rule, a policy, not a hardware figure: give --pinned-limit for yours (a container's memory cgroup, say).
Nodes hold `gpus_per_node` consecutive ranks (torchrun's rank = node_rank x nproc_per_node + local_rank):
by default the node's GPUs (8 on a DGX), or the world size if smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import ConfigError
from ..models.devices import NODE_HOSTS
from ..models.training import RankRanges
from ..simulator.events import Action, EventLog, Pool
from ..simulator.log_index import LogIndex
from ..simulator.timeline import timeline
from .ledger import row_name
from .units import Scale, format_bytes

# RSS of a Python process after `import torch`, torch 2.13.0+cpu (the CPU build), Python 3.11.7, Linux x86-64:
# /proc/self/statm resident pages x page size, 229,953,536 B (3 runs, 229.9 to 230.0 MB; bench/validate_host.py
# re-measures it: 5 runs, median within 0.02%). A CUDA process holds more (the CUDA runtime and the kernels' host
# copies): not measured here (no GPU), so this is a lower bound of each rank's host baseline.
PROCESS_BASELINE = 229_953_536
PINNED_SHARE = 0.5  # the default pinned limit: this share of the node's host memory (see the module docstring)


@dataclass(frozen=True)
class HostUse:
    """One rank's host memory over the run."""

    rank: int
    peak: int  # the highest host bytes at any moment
    pinned_at_peak: int  # of them, pinned
    pinned_peak: int  # the highest pinned bytes at any moment (its own maximum)

    @property
    def pageable_at_peak(self) -> int:
        return self.peak - self.pinned_at_peak

    def as_json(self) -> dict:
        return {"rank": self.rank, "peak": self.peak, "pinned_at_peak": self.pinned_at_peak,
                "pageable_at_peak": self.pageable_at_peak, "pinned_peak": self.pinned_peak, "unit": "B"}


def host_uses(log: EventLog, index: LogIndex | None = None) -> dict[int, HostUse]:
    """Every rank's host memory (ranks with no host block: none listed), from its Pool.HOST events in order
    (`index`: the log's, simulator/log_index.py, where they are found)."""
    total: dict[int, int] = {}
    pinned: dict[int, int] = {}
    out: dict[int, list[int]] = {}  # rank -> [peak, pinned at peak, pinned peak]
    events = log.events if index is None else map(log.events.__getitem__, index.pool_positions(Pool.HOST).tolist())
    for e in events:
        b = e.block
        if b.pool is not Pool.HOST:
            continue
        r = b.rank
        d = b.nbytes if e.action is Action.ALLOC else -b.nbytes
        t = total[r] = total.get(r, 0) + d
        p = pinned.get(r, 0)
        if b.pinned:
            p = pinned[r] = p + d
        top = out.setdefault(r, [0, 0, 0])
        if t > top[0]:
            top[0], top[1] = t, p
        if p > top[2]:
            top[2] = p
    return {r: HostUse(r, *v) for r, v in sorted(out.items())}


@dataclass(frozen=True)
class NodeNeed:
    """The worst node for one limit: which node, its ranks [first, stop), and what it needs."""

    node: int
    first: int
    stop: int
    need: int

    def as_json(self) -> dict:
        return {"node": self.node, "ranks": [self.first, self.stop], "need": self.need, "unit": "B"}


@dataclass(frozen=True)
class HostFit:
    """The host's verdict: every node's host need within `host_memory` and its pinned need within `pinned_limit`."""

    host_memory: int
    pinned_limit: int
    pinned_limit_rule: str  # "given", or how the default was made
    gpus_per_node: int
    baseline: int  # per rank
    host: NodeNeed  # the worst node by host need (peaks + baselines)
    pinned: NodeNeed  # the worst node by pinned need
    uses: tuple[HostUse, ...]  # each simulated rank's host memory
    source: str = ""  # where host_memory came from (--host-memory, or the profile's typical node)

    @property
    def asked(self) -> bool:
        """Judged on request (--host-memory or --pinned-limit given), not only by a profile's default node."""
        return self.source == "--host-memory" or self.pinned_limit_rule == "given"

    @property
    def said(self) -> bool:
        """Worth a report's lines: asked for, not fitting, or the run holds pinned host memory (a host-side technique
        in use); not for a run whose host holds only, say, Adam's step tensors against a default node."""
        return self.asked or not self.fits or any(u.pinned_peak for u in self.uses)

    @property
    def fits_ram(self) -> bool:
        return self.host.need <= self.host_memory

    @property
    def fits_pinned(self) -> bool:
        return self.pinned.need <= self.pinned_limit

    @property
    def fits(self) -> bool:
        return self.fits_ram and self.fits_pinned

    def text(self, unit: str | None = None) -> str:
        """"host: FITS (...)" or "host: DOES NOT FIT (needs X of Y per node ...)", one clause."""
        f = lambda n: format_bytes(n, unit)  # noqa: E731  (each figure its own unit: limits and needs differ widely)
        ram = f"{f(self.host.need)} of {f(self.host_memory)} per node"
        pin = f"pinned {f(self.pinned.need)} of {f(self.pinned_limit)}"
        if self.fits:
            return f"host: FITS ({ram}, {pin})"
        over = ([f"needs {ram}, node {self.host.node}: {_ranks(self.host)}"] if not self.fits_ram else [])
        over += ([f"{pin} per node, node {self.pinned.node}: {_ranks(self.pinned)}"] if not self.fits_pinned else [])
        return f"host: DOES NOT FIT ({'; '.join(over)})"

    def lines(self, unit: str | None = None) -> list[str]:
        """The report's host block: the rule, then the verdict."""
        f = lambda n: format_bytes(n, unit)  # noqa: E731
        return [f"host per node ({self.gpus_per_node} rank(s) a node; {self.source}): need {f(self.host.need)} = "
                f"the sum of its ranks' host peaks (conservative: the peaks need not coincide) + "
                f"{f(self.baseline)} a rank (torch's host RSS, measured for the CPU build: a lower bound); pinned "
                f"{f(self.pinned.need)} of a limit {f(self.pinned_limit)} ({self.pinned_limit_rule})",
                "  " + self.text(unit)]

    def as_json(self) -> dict:
        return {"fits": self.fits, "fits_host_memory": self.fits_ram, "fits_pinned_limit": self.fits_pinned,
                "host_memory": self.host_memory, "host_memory_source": self.source, "pinned_limit": self.pinned_limit,
                "pinned_limit_rule": self.pinned_limit_rule, "gpus_per_node": self.gpus_per_node,
                "baseline_per_rank": self.baseline, "worst_node_host": self.host.as_json(),
                "worst_node_pinned": self.pinned.as_json(), "ranks": [u.as_json() for u in self.uses],
                "rule": "need per node = sum over its ranks of each rank's host peak + the baseline per rank "
                        "(conservative: the peaks need not coincide); pinned likewise, without a baseline"}


@dataclass(frozen=True)
class HostLimits:
    """The host limits asked for (--host-memory, --pinned-limit, --gpus-per-node); None: the default."""

    host_memory: int | None = None
    pinned_limit: int | None = None
    gpus_per_node: int | None = None


def judge_host(log: EventLog, device: str, limits: HostLimits = HostLimits(),
               index: LogIndex | None = None) -> HostFit | None:
    """The host's verdict of the run in `log` on `device` (`host_fit`), or None where the host is not judged: no
    --host-memory, and no typical node for the profile (models/devices.py NODE_HOSTS) or nothing of the run on the
    host. The one place every command (simulate --check, explain, where) gets it. `index`: the log's
    (simulator/log_index.py; a report's `index`), read instead of its events."""
    node = NODE_HOSTS.get(device)
    if limits.host_memory is not None:
        return host_fit(log, limits.host_memory, limits.pinned_limit, limits.gpus_per_node, "--host-memory",
                        index=index)
    if node is None:
        if limits.pinned_limit is not None:
            raise ConfigError("pinned_limit", f"needs --host-memory: {device} has no typical node (those with one: "
                                              f"{', '.join(NODE_HOSTS)})")
        return None
    if limits.pinned_limit is None and not (index.has_pool(Pool.HOST) if index is not None else
                                            any(e.block.pool is Pool.HOST for e in log.events)):
        return None
    md = log.metadata
    world = md.setup.mesh.world_size if md.setup is not None else 1
    return host_fit(log, node.host_memory, limits.pinned_limit, limits.gpus_per_node or min(node.gpus_per_node, world),
                    f"{node.system}'s host memory, the {device} profile's typical node", index=index)


def host_ledger_lines(log: EventLog, rank: int, index: int, unit: str | None = None,
                      log_idx: LogIndex | None = None) -> list[str]:
    """The host's ledger of `rank` right after its host timeline's event `index` (the host peak): the ledger's rows
    (analysis/ledger.py), each with its pinned bytes; none where the rank holds no pinned host memory. `log_idx`:
    the log's index (simulator/log_index.py)."""
    use = host_uses(log, log_idx).get(rank)
    if use is None or not use.pinned_peak or index < 0:
        return []
    rows: dict[str, list[int]] = {}
    for b in timeline(log, rank, Pool.HOST, index=log_idx).live_blocks_at(index):
        row = rows.setdefault(row_name(b), [0, 0])
        row[0] += b.nbytes
        row[1] += b.nbytes if b.pinned else 0
    total, pinned = sum(v[0] for v in rows.values()), sum(v[1] for v in rows.values())
    g = Scale.of([total], unit)
    out = ["", f"host ledger at the host peak (rank {rank}; {g.unit}; exact totals in --json host_memory)",
           f"  {'row':<30}{'at peak':>14}{'pinned':>14}"]
    out += [f"  {name:<30}{g.number(b):>14}{g.number(p):>14}" for name, (b, p) in sorted(rows.items())]
    return out + [f"  {'total':<30}{g.number(total):>14}{g.number(pinned):>14}"]


def _ranks(n: NodeNeed) -> str:
    return f"rank {n.first}" if n.stop == n.first + 1 else f"ranks {n.first}-{n.stop - 1}"


def _classes(log: EventLog, simulated) -> dict[int, RankRanges]:
    """The ranks each simulated rank stands for (the log's rank classes, else itself)."""
    md = log.metadata
    if md.rank_class_ranges is not None:
        return {int(r): RankRanges.from_json(m) for r, m in md.rank_class_ranges.items()}
    if md.rank_classes:
        return {int(r): RankRanges.of(m) for r, m in md.rank_classes.items()}
    return {r: RankRanges([(r, r + 1)]) for r in simulated}


def _worst_node(segments: list[tuple[int, int, int]], world: int, g: int, baseline: int) -> NodeNeed:
    """The node with the highest sum of its ranks' values + `baseline` per rank; `segments`: disjoint [start, stop)
    rank ranges, each rank of one holding its value (the others 0). Nodes wholly inside one segment are alike: one
    of them stands for all (O(segments), not O(nodes))."""
    sums: dict[int, int] = {0: 0}
    for start, stop, v in segments:
        if not v or start >= stop:
            continue
        n0, n1 = start // g, (stop - 1) // g
        sums[n0] = sums.get(n0, 0) + v * (min(stop, (n0 + 1) * g) - start)
        if n1 != n0:
            sums[n1] = sums.get(n1, 0) + v * (stop - n1 * g)
            if n1 - n0 > 1:
                sums.setdefault(n0 + 1, v * g)  # wholly inside: its ranks are this segment's alone

    def need(n: int) -> int:
        return sums[n] + baseline * (min(world, (n + 1) * g) - n * g)

    worst = max(sums, key=lambda n: (need(n), -n))
    return NodeNeed(worst, worst * g, min(world, (worst + 1) * g), need(worst))


def host_fit(log: EventLog, host_memory: int, pinned_limit: int | None = None, gpus_per_node: int | None = None,
             source: str = "--host-memory", baseline: int = PROCESS_BASELINE, index: LogIndex | None = None) -> HostFit:
    """The host's verdict of the run in `log` (see the module docstring); `gpus_per_node` None: 8, or the world
    size if smaller; `pinned_limit` None: PINNED_SHARE of `host_memory`; `index`: the log's (simulator/log_index.py),
    read instead of its events."""
    uses = host_uses(log, index)
    md = log.metadata
    ranks = index.ranks() if index is not None else sorted({e.block.rank for e in log.events})
    world = md.setup.mesh.world_size if md.setup is not None else (max(ranks) + 1 if ranks else 1)
    g = max(1, gpus_per_node if gpus_per_node is not None else min(8, world))
    classes = _classes(log, ranks)
    host_seg, pin_seg = [], []
    for r, ranges in classes.items():
        u = uses.get(r)
        if u is None:
            continue
        for a, b in ranges.ranges:
            host_seg.append((a, b, u.peak))
            pin_seg.append((a, b, u.pinned_peak))
    rule = "given"
    if pinned_limit is None:
        pinned_limit = int(host_memory * PINNED_SHARE)
        rule = (f"{PINNED_SHARE:.0%} of host memory, this tool's rule: the CUDA driver pins without mlock, so "
                "ulimit -l does not bound it; RAM does")
    return HostFit(host_memory, pinned_limit, rule, g, baseline, _worst_node(host_seg, world, g, baseline),
                   _worst_node(pin_seg, world, g, 0), tuple(uses.values()), source)


__all__ = ["HostFit", "HostLimits", "HostUse", "NodeNeed", "PINNED_SHARE", "PROCESS_BASELINE", "host_fit",
           "host_ledger_lines", "host_uses", "judge_host"]
