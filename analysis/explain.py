"""OOM explain: which allocation does not fit, what is live at that moment, and why.

Works on any event log (simulated or measured): replaying the events of one (rank, pool) against a
capacity finds the first allocation that does not fit; the live set at that moment is split into
model states (parameters, gradients, fp32 masters, optimizer states), activations (saved activations,
temporaries, the batch) and communication / staging buffers, which says whether the failure is
state-heavy (shard states: ZeRO / FSDP, 8-bit optimizer, freezing) or activation-heavy (checkpointing,
a smaller micro-batch with more accumulation, a shorter context). The fixes themselves are
re-simulated by `peakledger.api.explain`; this module only reads logs.

A CUDA snapshot is also read in reserved terms (`reserved_moment`: the segments cudaMalloc holds, the first
segment after which they exceed the budget, else their peak), with the allocated bytes at that moment (`live_at`:
the two views number their events together). A measured trace's state at record start (its leading pre-existing
allocations) counts as one moment (`Moment.at_start`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import TrainingSetup
from ..simulator.events import Block, Category, Event, EventLog, OOMRecord, Pool
from ..simulator.timeline import timeline
from ..traces.cuda_snapshot import PREEXISTING_OP as START_OP
from .phases import PhasePeak, floor
from .units import Scale, format_bytes

MODEL_STATES = frozenset({Category.PARAMETER, Category.GRADIENT, Category.MASTER_PARAMETER, Category.OPTIMIZER_STATE})
ACTIVATIONS = frozenset({Category.ACTIVATION, Category.TEMPORARY, Category.INPUT})
START_WHY = "the state at record start: memory allocated before the recording began (its blocks are named pre-existing)"


@dataclass(frozen=True)
class Moment:
    """What was live on one (rank, pool) when an allocation failed, or at the peak when none failed."""

    rank: int
    pool: Pool
    event: Event  # the failing allocation (not performed), or the peak event
    live_bytes: int  # before the failing allocation / at the peak
    capacity: int | None
    by_category: dict[Category, int]
    largest: tuple[Block, ...]
    failed: bool
    at_start: bool = False  # the state at record start of a measured trace (a CUDA snapshot's pre-existing blocks)

    @property
    def state_bytes(self) -> int:
        return sum(b for c, b in self.by_category.items() if c in MODEL_STATES)

    @property
    def activation_bytes(self) -> int:
        return sum(b for c, b in self.by_category.items() if c in ACTIVATIONS)

    @property
    def other_bytes(self) -> int:
        return self.live_bytes - self.state_bytes - self.activation_bytes

    @property
    def heavy(self) -> str:
        """"state-heavy" when model states outweigh activations at this moment, else "activation-heavy"."""
        return "state-heavy" if self.state_bytes >= self.activation_bytes else "activation-heavy"

    @property
    def shortfall(self) -> int:
        """Bytes missing: live + the failing block - capacity (0 when nothing failed)."""
        if not self.failed or self.capacity is None:
            return 0
        return self.live_bytes + self.event.block.nbytes - self.capacity


def cause(event: Event, by_category: dict[Category, int], setup: TrainingSetup | None = None) -> str:
    """One sentence on why memory is high at `event`: the transient that happens there, if a known one.
    `setup` (the log's, from its metadata) names what only the setup can tell."""
    cat, phase = event.block.category, event.phase.value
    states = by_category.get(Category.OPTIMIZER_STATE, 0)
    offload = setup.offload.mode if setup is not None else "none"
    if (phase == "optimizer" and event.step == 1 and offload != "none" and setup.offload.first_step != "chunked"
            and not event.op.startswith(("optimizer.chunk", "optimizer.offload"))):
        later = ("every state comes back for the whole step" if offload == "states" else
                 f"at most {setup.offload.prefetch + 1} chunk(s) of {setup.offload.chunk_params:,} "
                 "parameters come back at a time; offload_first_step=\"chunked\" creates them chunk by chunk too")
        return (f"the first step is one whole torch step() on the device: it creates every optimizer state lazily "
                f"inside it, beside its parameter ({states:,} B of states now), and runs the update over all of them "
                f"and their temporaries before the offload can move any to the host; from step 2 the states live on "
                f"the host and {later}")
    if phase == "optimizer" and event.step == 1 and (cat is Category.OPTIMIZER_STATE
                                                     or event.op == "optimizer.init_state"):
        return ("the first optimizer step creates the optimizer states lazily inside step(), while every gradient "
                "is still live; later steps start with them already allocated")
    if phase == "optimizer" and cat is Category.TEMPORARY:
        first = " (the states were just created: this is the first step)" if event.step == 1 else ""
        return (f"the optimizer step's temporaries (foreach/for-loop sqrt and fp32 gradient copies) on top of "
                f"{states:,} B of optimizer states{first}; a fused optimizer has none")
    if phase == "checkpoint" or cat is Category.CHECKPOINT_STAGING:
        return "saving a checkpoint: staging copies of the state on top of the training state"
    if cat is Category.ALL_GATHER_BUFFER:
        return "a ZeRO-3 / FSDP all-gather rebuilds full parameters (prefetch can hold more than one unit)"
    if cat is Category.REDUCE_SCATTER_BUCKET:
        return "a gradient reduce bucket is being filled or reduced"
    if event.block.name.startswith("vllm."):
        return vllm_cause(event)
    kv = by_category.get(Category.KV_CACHE, 0)
    if phase in ("prefill", "decode", "generate") or cat is Category.KV_CACHE:
        return (f"generation ({phase}): the KV cache ({kv:,} B now) beside the training state; a dynamic cache "
                f"concatenates each step (old and new keys / values live at once), a static one holds max_length "
                f"from the prefill on; fewer sequences per batch, a shorter max_new_tokens or a smaller cache dtype "
                f"lower it")
    if cat is Category.PREDICTIONS or (phase == "eval" and by_category.get(Category.PREDICTIONS)):
        return (f"evaluation: the logits of every eval batch so far are kept on the device "
                f"({by_category.get(Category.PREDICTIONS, 0):,} B) until eval_accumulation_steps moves them to the "
                f"CPU (HF Trainer's evaluation_loop); set it, or preprocess_logits_for_metrics to keep less")
    if phase == "backward":
        return "backward: saved activations are still live while gradients of activations are produced"
    if phase == "forward":
        return "forward: saved activations accumulate layer by layer"
    return f"{phase}: {cat.value} {event.block.name}"


def vllm_cause(event: Event) -> str:
    """A colocated vLLM engine's own memory (models/rl.py, models/vllm_engine.py; vLLM 0.32.0)."""
    b = event.block
    how = ("mapped by vLLM's CuMemAllocator outside torch's caching allocator (sleep mode: torch's cache is emptied "
           "first, its partly used segments stay)" if b.outside_allocator else
           "allocated through torch's caching allocator (no sleep mode)")
    if b.name == "vllm.kv_cache":
        return (f"vLLM's KV-cache pool ({b.nbytes:,} B), {how}, beside the training process's memory; its size is "
                "fixed when the engine starts, ceil(total x gpu_memory_utilization) less vLLM's weights and its "
                "profile run's peak (gpu_worker.py determine_available_memory), whatever the rollout batch: a lower "
                "vllm_gpu_memory_utilization (or kv_cache_dtype fp8 with it) shrinks it, offloading the reference "
                "model makes room beside it")
    if b.name == "vllm.weights":
        return (f"vLLM's own copy of the weights ({b.nbytes:,} B), {how}, beside the policy, its optimizer states "
                "and the reference model; sleep level 2 discards it between rollouts instead of keeping a host copy, "
                "offloading the reference model makes room beside it")
    return (f"vLLM's {b.name.removeprefix('vllm.')} ({b.nbytes:,} B), {how}, beside the training process's memory; "
            "a lower vllm_gpu_memory_utilization shrinks the engine's share")


def _is_start(e: Event) -> bool:
    return e.op.startswith(START_OP)


def first_oom(log: EventLog, capacity: int, rank: int = 0, pool: Pool = Pool.DEVICE) -> Moment | None:
    """Replay one (rank, pool) against `capacity`: the first allocation that would exceed it. A measured trace's
    state at record start (its leading pre-existing allocations) is one moment: over, it is the first (at_start)."""
    live: dict[int, Block] = {}
    in_use = 0
    events = timeline(log, rank, pool).events
    start = next((i for i, e in enumerate(events) if not _is_start(e)), len(events))
    for e in events[:max(start - 1, 0)]:
        live[e.block.id] = e.block
        in_use += e.block.nbytes
    if start and in_use + events[start - 1].block.nbytes > capacity:
        return _moment(rank, pool, events[start - 1], in_use, capacity, live, failed=True, at_start=True)
    for e in events[max(start - 1, 0):]:
        if e.action.value == "alloc":
            if in_use + e.block.nbytes > capacity:
                return _moment(rank, pool, e, in_use, capacity, live, failed=True)
            live[e.block.id] = e.block
            in_use += e.block.nbytes
        else:
            in_use -= live.pop(e.block.id).nbytes
    return None


def from_record(record: OOMRecord) -> Moment:
    """A simulator's (or a CUDA snapshot's) own OOM record as a Moment."""
    e = record.event
    return Moment(rank=e.block.rank, pool=e.block.pool, event=e, live_bytes=record.live_bytes,
                  capacity=record.capacity, by_category=dict(record.live_by_category),
                  largest=tuple(record.largest_live), failed=True)


def peak_moment(log: EventLog, rank: int = 0, pool: Pool = Pool.DEVICE, capacity: int | None = None) -> Moment:
    """The peak of one (rank, pool), as a Moment (for runs that fit)."""
    tl = timeline(log, rank, pool)
    pk = tl.peak()
    live = {b.id: b for b in tl.live_blocks_at(pk.index)} if pk.event is not None else {}
    return _moment(rank, pool, pk.event, pk.bytes, capacity, live, failed=False,
                   at_start=pk.event is not None and _is_start(pk.event))


def _moment(rank, pool, event, in_use, capacity, live: dict[int, Block], failed: bool,
            at_start: bool = False) -> Moment:
    by_cat: dict[Category, int] = {}
    for b in live.values():
        by_cat[b.category] = by_cat.get(b.category, 0) + b.nbytes
    largest = tuple(sorted(live.values(), key=lambda b: (-b.nbytes, b.id))[:8])
    return Moment(rank=rank, pool=pool, event=event, live_bytes=in_use, capacity=capacity, by_category=by_cat,
                  largest=largest, failed=failed, at_start=at_start)


def worst_moment(log: EventLog, capacity: int, pool: Pool = Pool.DEVICE) -> Moment:
    """Across every rank in the log: the earliest failing allocation, else the highest peak."""
    ranks = sorted({e.block.rank for e in log.events if e.block.pool is pool})
    failures = [m for r in ranks if (m := first_oom(log, capacity, r, pool)) is not None]
    if failures:
        return min(failures, key=lambda m: (m.event.seq, m.rank))
    peaks = [peak_moment(log, r, pool, capacity) for r in ranks]
    return max(peaks, key=lambda m: (m.live_bytes, -m.rank))


def moment_json(m: Moment, setup: TrainingSetup | None = None, binds: PhasePeak | None = None) -> dict:
    """A Moment as JSON (the `moment` object of explain --json); `binds`: the binding state phase, if any
    (analysis/phases.py `binding`)."""
    e = m.event
    return {"rank": m.rank, "pool": m.pool.value, "failed": m.failed, "at_record_start": m.at_start, "op": e.op,
            "phase": e.phase.value,
            "step": e.step, "micro_batch_index": e.micro_batch_index, "tensor": e.block.name,
            "tensor_bytes": e.block.nbytes,
            "tensor_category": e.block.category.value, "live_bytes": m.live_bytes, "capacity": m.capacity,
            "shortfall": m.shortfall, "heavy": m.heavy,
            "binding": None if binds is None else {"step": binds.step, "phase": binds.phase.value,
                                                   "bytes": floor(binds), "op": binds.op},
            "why": START_WHY if m.at_start else cause(e, m.by_category, setup),
            "model_state_bytes": m.state_bytes,
            "activation_bytes": m.activation_bytes, "other_bytes": m.other_bytes,
            "live_by_category": {c.value: b for c, b in sorted(m.by_category.items(), key=lambda cb: -cb[1])},
            "largest": [{"name": b.name, "bytes": b.nbytes, "category": b.category.value, "dtype": b.dtype}
                        for b in m.largest]}


def render_moment(m: Moment, u: str | None, setup: TrainingSetup | None = None,
                  binds: PhasePeak | None = None) -> list[str]:
    """A Moment as text lines, sizes in unit `u`; `binds`: the state phase that binds (analysis/phases.py
    `binding`), named in place of the moment's own mix."""
    f = lambda n: format_bytes(n, u)  # noqa: E731
    e = m.event
    where = f"{e.op} ({e.phase.value}, step {e.step}" \
        + (f", micro-batch {e.micro_batch_index}" if e.micro_batch_index >= 0 else "") \
        + f"; rank {m.rank} {m.pool.value} memory)"
    if m.failed and m.at_start:
        lines = [f"OUT OF MEMORY already at record start ({m.pool.value} memory of rank {m.rank})",
                 f"  the state before the trace's first entry holds {f(m.live_bytes + e.block.nbytes)} of "
                 f"{f(m.capacity)}: {f(m.shortfall)} short"]
    elif m.failed:
        lines = [f"OUT OF MEMORY first at {where}",
                 f"  allocating {e.block.name} ({e.block.category.value}, {f(e.block.nbytes)}) with {f(m.live_bytes)} "
                 f"live of {f(m.capacity)}: {f(m.shortfall)} short"]
    else:
        room = f"{f(m.capacity - m.live_bytes)} to spare" if m.capacity is not None else ""
        at = f"record start (rank {m.rank} {m.pool.value} memory)" if m.at_start else where
        lines = [f"fits: peak {f(m.live_bytes)} at {at}" + (f"; {room}" if room else "")]
    lines.append(f"  why: {START_WHY if m.at_start else cause(e, m.by_category, setup)}")
    if binds is not None and m.capacity is not None:
        lines.append(f"  state-bound: {binds.label} needs {f(floor(binds))} with no activations live (at {binds.op}), "
                     f"over {f(m.capacity)} by {f(floor(binds) - m.capacity)}: no fix of the forward or backward "
                     "lowers it (checkpointing, a smaller micro-batch); shard, shrink or offload the states")
        lines.append(f"  at this moment: model states {f(m.state_bytes)}, activations/temporaries/batch "
                     f"{f(m.activation_bytes)}, buffers {f(m.other_bytes)}")
    else:
        lines.append(f"  {m.heavy}: model states {f(m.state_bytes)}, activations/temporaries/batch "
                     f"{f(m.activation_bytes)}, buffers {f(m.other_bytes)}")
    lines.append("  live by category: " + ", ".join(f"{c.value} {f(b)}" for c, b in
                                                     sorted(m.by_category.items(), key=lambda cb: -cb[1]) if b))
    g = Scale.of([b.nbytes for b in m.largest], u)
    lines.append(f"  largest live blocks ({g.unit}):")
    lines += [f"    {g.number(b.nbytes):>12}  {b.category.value:<22} {b.name}" for b in m.largest]
    return lines


def live_at(log: EventLog, seq: int, rank: int = 0, pool: Pool = Pool.DEVICE) -> int:
    """Bytes live on one (rank, pool) of `log` just before the event numbered `seq` (of this or a sibling log that
    numbers its events together with it: a CUDA snapshot's allocated and reserved views)."""
    return sum(e.delta for e in log.events if e.seq < seq and e.block.rank == rank and e.block.pool is pool)


def live_at_moment(log: EventLog, m: Moment) -> int:
    """Bytes live in `log` (the other view of the same snapshot) at Moment `m`: the whole state at record start for
    an at_start moment, else what was live just before its event."""
    if m.at_start:
        return sum(e.delta for e in log.events if _is_start(e) and e.block.rank == m.rank and e.block.pool is m.pool)
    return live_at(log, m.event.seq, m.rank, m.pool)


def reserved_moment(reserved: EventLog, capacity: int) -> Moment:
    """A CUDA snapshot's reserved view (the segments cudaMalloc holds) against `capacity`: the first segment after
    which reserved bytes exceed it (`failed`; live_bytes = reserved before it), else the reserved peak."""
    return worst_moment(reserved, capacity)


def reserved_moment_json(m: Moment, allocated: int | None = None) -> dict:
    """The reserved Moment as JSON (the `reserved_moment` object of explain --trace --json); `allocated` is the
    allocated bytes at that moment, when the allocated view is known."""
    e = m.event
    after = m.live_bytes + (e.block.nbytes if m.failed else 0)
    return {"view": "reserved", "rank": m.rank, "pool": m.pool.value, "failed": m.failed,
            "at_record_start": m.at_start, "op": e.op,
            "phase": e.phase.value, "segment": e.block.name, "segment_bytes": e.block.nbytes,
            "reserved_before": m.live_bytes, "reserved_after": after, "capacity": m.capacity,
            "over_by": max(after - m.capacity, 0) if m.capacity is not None else 0, "allocated_bytes": allocated,
            "cached_free_bytes": None if allocated is None else after - allocated,
            "largest": [{"name": b.name, "bytes": b.nbytes} for b in m.largest]}


def render_reserved_moment(m: Moment, u: str | None, allocated: int | None = None) -> list[str]:
    """The reserved Moment as text lines, sizes in unit `u`."""
    f = lambda n: format_bytes(n, u)  # noqa: E731
    e = m.event
    where = f"{e.op} ({e.phase.value}; rank {m.rank} {m.pool.value} memory)"
    if m.at_start:
        where = f"record start (rank {m.rank} {m.pool.value} memory: segments reserved before recording began)"
    if m.failed and m.at_start:
        after = m.live_bytes + e.block.nbytes
        lines = [f"RESERVED over the budget already at {where}",
                 f"  {f(after)} reserved before the trace's first entry: {f(after - m.capacity)} over {f(m.capacity)}"]
    elif m.failed:
        after = m.live_bytes + e.block.nbytes
        lines = [f"RESERVED over the budget first at {where}",
                 f"  a new segment of {f(e.block.nbytes)} ({e.block.name}) takes reserved from {f(m.live_bytes)} to "
                 f"{f(after)}: {f(after - m.capacity)} over {f(m.capacity)}"]
    else:
        after = m.live_bytes
        room = f"; {f(m.capacity - m.live_bytes)} to spare" if m.capacity is not None else ""
        lines = [f"reserved fits: peak {f(m.live_bytes)} at {where}{room}"]
    if allocated is not None:
        lines.append(f"  allocated then {f(allocated)}; cached in segments but free {f(after - allocated)}")
    g = Scale.of([b.nbytes for b in m.largest], u)
    lines.append(f"  largest reserved segments ({g.unit}):")
    lines += [f"    {g.number(b.nbytes):>12}  {b.name}" for b in m.largest]
    return lines


__all__ = ["moment_json", "render_moment", "live_at", "live_at_moment", "reserved_moment", "reserved_moment_json",
           "render_reserved_moment", "Moment", "cause", "first_oom", "from_record", "peak_moment", "worst_moment",
           "MODEL_STATES", "ACTIVATIONS"]
