"""The ledger: where the bytes are at a moment (by default the peak), one row per kind of memory.

Rows are categories, with optimizer states split by state name (exp_avg, exp_avg_sq, ...), each
with exact bytes, dtype(s), shard factor(s), number of tensors and its share of the total. A ledger
is never only a total: the point is to see which row to attack.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..simulator.events import Block, Category
from ..simulator.timeline import Timeline

ROW_ORDER = [Category.PARAMETER, Category.GRADIENT, Category.MASTER_PARAMETER, Category.OPTIMIZER_STATE,
             Category.ACTIVATION, Category.TEMPORARY, Category.INPUT, Category.BUFFER, Category.ALL_GATHER_BUFFER,
             Category.REDUCE_SCATTER_BUCKET, Category.CHECKPOINT_STAGING, Category.UNKNOWN]


@dataclass(frozen=True)
class LedgerRow:
    row: str  # "parameter", "optimizer_state.exp_avg", ...
    category: Category
    bytes: int
    dtype: str  # "bf16", or "bf16+fp32" when mixed
    shard_factor: int | str  # an int, or "1..8" when the row mixes factors
    tensors: int
    share: float  # of the ledger's total

    def as_json(self) -> dict:
        return {"row": self.row, "category": self.category.value, "bytes": self.bytes, "unit": "B",
                "dtype": self.dtype, "shard_factor": self.shard_factor, "tensors": self.tensors,
                "share": round(self.share, 6)}


def row_name(block: Block) -> str:
    if block.category is Category.OPTIMIZER_STATE and block.state is not None:
        return f"optimizer_state.{block.state.value}"
    return block.category.value


def ledger(blocks: list[Block]) -> list[LedgerRow]:
    groups: dict[str, list[Block]] = {}
    for b in blocks:
        groups.setdefault(row_name(b), []).append(b)
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
    return ledger(tl.live_blocks_at(event_index))
