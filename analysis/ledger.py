"""The ledger: where the bytes are at a moment (by default the peak), one row per kind of memory.

Rows are categories, with optimizer states split by state name (exp_avg, exp_avg_sq, ...), each
with exact bytes, dtype(s), shard factor(s), number of tensors and its share of the total. A ledger
is never only a total: the point is to see which row to attack. A row's maximum over a run whose later
steps repeat simulated ones (models/training.StepPlan) is its maximum over the simulated steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..simulator.events import Block, Category
from ..simulator.timeline import Timeline

ROW_ORDER = [Category.PARAMETER, Category.GRADIENT, Category.MASTER_PARAMETER, Category.OPTIMIZER_STATE,
             Category.ACTIVATION, Category.KV_CACHE, Category.PREDICTIONS, Category.TEMPORARY, Category.INPUT,
             Category.BUFFER, Category.ALL_GATHER_BUFFER, Category.REDUCE_SCATTER_BUCKET, Category.CHECKPOINT_STAGING,
             Category.WORKSPACE, Category.UNKNOWN]


@dataclass(frozen=True)
class LedgerRow:
    row: str  # "parameter", "optimizer_state.exp_avg", ...
    category: Category
    bytes: int
    dtype: str  # "bf16", or "bf16+fp32" when mixed
    shard_factor: int | str  # an int, or "1..8" when the row mixes factors
    tensors: int
    share: float  # of the ledger's total
    max_bytes: int = 0  # the row's own highest value over the whole run (not necessarily at the peak)

    def as_json(self) -> dict:
        return {"row": self.row, "category": self.category.value, "bytes": self.bytes, "unit": "B",
                "dtype": self.dtype, "shard_factor": self.shard_factor, "tensors": self.tensors,
                "share": round(self.share, 6), "max_bytes": self.max_bytes}


ADAPTER_MARKERS = (".lora_A.", ".lora_B.")  # peft's adapter parameter names (models/lora.py)


def is_adapter(block: Block) -> bool:
    return any(m in block.name for m in ADAPTER_MARKERS)


def row_name(block: Block, lora: bool = False) -> str:
    """The row of a block. `lora`: the run has LoRA adapters, and its parameters split into
    "parameter.adapter" (trained) and "parameter.frozen_base" (every other parameter: peft freezes them all)."""
    if block.category is Category.OPTIMIZER_STATE and block.state is not None:
        return f"optimizer_state.{block.state.value}"
    if lora and block.category is Category.PARAMETER:
        return "parameter.adapter" if is_adapter(block) else "parameter.frozen_base"
    return block.category.value


def has_adapters(blocks) -> bool:
    return any(b.category is Category.PARAMETER and is_adapter(b) for b in blocks)


def ledger(blocks: list[Block], lora: bool | None = None) -> list[LedgerRow]:
    lora = has_adapters(blocks) if lora is None else lora
    groups: dict[str, list[Block]] = {}
    for b in blocks:
        groups.setdefault(row_name(b, lora), []).append(b)
    total = sum(b.nbytes for b in blocks) or 1
    rows = []
    for name, bs in groups.items():
        dtypes = sorted({b.dtype for b in bs})
        shards = sorted({b.shard_factor for b in bs})
        rows.append(LedgerRow(row=name, category=bs[0].category, bytes=sum(b.nbytes for b in bs),
                              dtype="+".join(dtypes), tensors=len(bs),
                              shard_factor=shards[0] if len(shards) == 1 else f"{shards[0]}..{shards[-1]}",
                              share=sum(b.nbytes for b in bs) / total))
    rows.sort(key=lambda r: (ROW_ORDER.index(r.category), r.row))
    return rows


def ledger_at(tl: Timeline, event_index: int) -> list[LedgerRow]:
    """The ledger of what is live right after `event_index`, with every row the run ever had
    (0 bytes at that moment if none) and each row's own maximum over the run."""
    lora = has_adapters(e.block for e in tl.events)
    rows = {r.row: r for r in ledger(tl.live_blocks_at(event_index), lora)}
    highest, first_block = _row_maxima(tl, lora)
    out = []
    for name, top in highest.items():
        b = first_block[name]
        row = rows.get(name) or LedgerRow(row=name, category=b.category, bytes=0, dtype=b.dtype,
                                          shard_factor=b.shard_factor, tensors=0, share=0.0)
        out.append(replace(row, max_bytes=top))
    out.sort(key=lambda r: (ROW_ORDER.index(r.category), r.row))
    return out


def _row_maxima(tl: Timeline, lora: bool) -> tuple[dict[str, int], dict[str, Block]]:
    """Each row's highest bytes over the timeline (from 0) and the block of its first event. A row that is a whole
    category reads its column of the timeline (int64: exact); the rows a category splits into (optimizer states by
    name, LoRA's parameters) walk that category's events; every row walks the events where the columns are Python
    ints (object arrays)."""
    split = {Category.OPTIMIZER_STATE} | ({Category.PARAMETER} if lora else set())
    columns = tl.total.dtype != object
    highest: dict[str, int] = {}
    first_block: dict[str, Block] = {}
    running: dict[str, int] = {}
    for e in tl.events if not columns else (e for e in tl.events if e.block.category in split):
        name = row_name(e.block, lora)
        running[name] = running.get(name, 0) + e.delta
        highest[name] = max(highest.get(name, 0), running[name])
        first_block.setdefault(name, e.block)
    if columns:
        for c, first in tl.first_seen:
            if c not in split:
                highest[c.value] = max(0, int(tl.by_category[c].max()))
                first_block[c.value] = tl.events[first].block
    return highest, first_block
