"""The allocator model replayed on every real CUDA snapshot: a table, one row per snapshot.

    python bench/validate_allocator.py [--dir ../shared/gpu-truth/snapshots] [--alloc-conf TEXT] [--json] [--write]

Each snapshot's state at record start is rebuilt from its final `segments`, its alloc / free_completed requests are
replayed through simulator/allocator.py, and the model's segment events, reserved after every trace event, peaks,
block addresses and final layout are compared with what torch's allocator did (analysis/allocator_replay.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sections import replace_section  # bench/sections.py, beside this script

from peakledger.analysis.allocator_replay import replay_snapshot

SECTION = "## GPU allocator: replay of real CUDA snapshots"

DEFAULT_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "gpu-truth" / "snapshots"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--alloc-conf", default="")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write", action="store_true", help=f"write '{SECTION[3:]}' into bench/VALIDATION.md")
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
    lines = ["| snapshot | trace events | segments matched / measured | reserved peak measured / predicted (GiB) | "
             "allocated peak measured / predicted (GiB) | reserved exact | block addresses | final layout |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['snapshot']} | {r['trace_events']:,} | "
                     f"{r['segments_matched']} / {r['segments_measured']} | "
                     f"{r['reserved_peak']['measured'] / gib:.3f} / {r['reserved_peak']['predicted'] / gib:.3f} | "
                     f"{r['allocated_peak']['measured'] / gib:.3f} / {r['allocated_peak']['predicted'] / gib:.3f} | "
                     f"{r['reserved_exact_fraction']:.4f} | {r['block_addresses_matched']} / {r['allocs']} | "
                     f"{'same' if r['final_layout_matches'] else 'differs'} |")
    print("\n".join(lines))
    if args.write:
        matched = sum(r["segments_matched"] == r["segments_measured"] and r["reserved_exact_fraction"] == 1.0
                      and r["final_layout_matches"] for r in rows)
        replace_section(SECTION, "\n".join([
            SECTION, "",
            "The allocator model (simulator/allocator.py: torch 2.6's CUDACachingAllocator rules) replayed on the "
            f"{len(rows)} real CUDA snapshots of ../shared/gpu-truth (torch 2.6, H100-class, default settings): "
            "each snapshot's state at record start rebuilt from its final segments, its requests replayed, and the "
            "model's segment events, reserved bytes after every trace event, peaks, block addresses and final "
            f"layout compared with the real allocator's (`python bench/validate_allocator.py --write`; also "
            f"`peakledger replay SNAPSHOT`). **{matched}/{len(rows)} snapshots equal in all of them.** Where the "
            "trace shows segment frees the model did not cause, the replay takes them as the user's "
            "`empty_cache()` and asks the model which segments go; new segments take the trace's addresses "
            "(cudaMalloc's choice, which nothing predicts). Not exercised by these snapshots (one device, one "
            "stream, no OOM): streams, retries at the device limit (synthetic tests only).", "", *lines, ""]))
        print(f"wrote {SECTION[3:]!r} into bench/VALIDATION.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
