"""Export a run for other tools: a CUDA-snapshot pickle (torch's `_memory_viz`, pytorch.org/memory_viz) and a
Chrome trace JSON (Perfetto, chrome://tracing). Both are written atomically (simulator/safe_io.py `write_atomic`)
and are deterministic: the same run gives the same bytes.

- `to_snapshot` / `write_snapshot` (analysis/export_snapshot.py): torch.cuda.memory._snapshot()'s format. On a
  CUDA device profile, the modelled caching allocator's view: its segments at the end, tiled exactly by their
  blocks, and every allocator action (segment_alloc / segment_free, alloc, free_requested / free_completed, oom)
  per rank, as `gpu_memory` (analysis/device.py) replays the run. On the cpu profile (no caching allocator) each
  tensor is its own segment.
- `chrome_trace` / `write_chrome_trace` (analysis/export_chrome.py): step, phase and op duration slices per rank and
  stream, beside counters of the bytes live per category and an instant event per allocation and free.

Both show the events of the log: for a simulation whose later steps repeat simulated ones
(models/training.StepPlan) those are the simulated steps only; the Chrome trace says so in `otherData`
(`steps`, `steps_simulated`, `note`), the snapshot under its `peakledger` key.
"""

from __future__ import annotations

import json
import pickle

from ..simulator.events import EventLog
from ..simulator.ops import OpGraph
from ..simulator.safe_io import write_atomic
from .export_chrome import chrome_trace
from .export_snapshot import to_snapshot

__all__ = ["chrome_trace", "to_snapshot", "write_chrome_trace", "write_html", "write_snapshot"]

PICKLE_PROTOCOL = 4  # torch's MemoryViz.js reads protocols 2 to 4


def write_chrome_trace(log: EventLog, path: str, graph: OpGraph | None = None) -> None:
    """`chrome_trace(log, graph)` as compact JSON; give the op graph the log came from for every op's slice."""
    write_atomic(path, json.dumps(chrome_trace(log, graph), separators=(",", ":")).encode())


def write_snapshot(log: EventLog, path: str) -> None:
    write_atomic(path, pickle.dumps(to_snapshot(log), protocol=PICKLE_PROTOCOL))


def write_html(path: str, page: str) -> None:
    """An HTML report (analysis/export_html.py `html_report`), written atomically."""
    write_atomic(path, page.encode())
