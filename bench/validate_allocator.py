"""The allocator model replayed on every real CUDA snapshot: a table, one row per snapshot.

    python bench/validate_allocator.py [--dir ../shared/gpu-truth/snapshots] [--alloc-conf TEXT] [--json]

Each snapshot's state at record start is rebuilt from its final `segments`, its alloc / free_completed requests are
replayed through simulator/allocator.py, and the model's segment events, reserved after every trace event, peaks,
block addresses and final layout are compared with what torch's allocator did (analysis/allocator_replay.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peakledger.analysis.allocator_replay import replay_snapshot

DEFAULT_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "gpu-truth" / "snapshots"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--alloc-conf", default="")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    paths = sorted(args.dir.glob("*.pickle"))
    if not paths:
        print(f"no snapshots in {args.dir}", file=sys.stderr)
        return 2
    rows = []
    for p in paths:
        r = replay_snapshot(p, args.alloc_conf)
        r.pop("devices")
        rows.append({"snapshot": p.name, **r})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    gib = 1 << 30
    print("| snapshot | trace events | segments matched / measured | reserved peak measured / predicted (GiB) | "
          "allocated peak measured / predicted (GiB) | reserved exact | block addresses | final layout |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['snapshot']} | {r['trace_events']:,} | {r['segments_matched']} / {r['segments_measured']} | "
              f"{r['reserved_peak']['measured'] / gib:.3f} / {r['reserved_peak']['predicted'] / gib:.3f} | "
              f"{r['allocated_peak']['measured'] / gib:.3f} / {r['allocated_peak']['predicted'] / gib:.3f} | "
              f"{r['reserved_exact_fraction']:.4f} | {r['block_addresses_matched']} / {r['allocs']} | "
              f"{'same' if r['final_layout_matches'] else 'differs'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
