"""The allocator model on every real snapshot of ../shared/gpu-truth, under the rules of the torch that recorded each.

    python bench/validate_torch_rules.py [--shared ../shared/gpu-truth] [--json] [--write]

Which torch recorded each (the folders' READMEs): snapshots/ torch 2.6.0 (H100-class; snapshots/../README.md
"Environment"), h200/ torch 2.11.0+cu130 (h200/README.md, first paragraph; matrix/manifest.json `device.torch`).
Each is replayed as `peakledger replay` does (analysis/allocator_replay.py `replay_entries`: the state at record
start rebuilt from the final segments, every request replayed), with the settings parsed under that torch's rule set
(simulator/torch_rules `nearest`), and compared: segment events, reserved after every event, final layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpu_snapshots import read_raw_snapshot  # bench/gpu_snapshots.py, beside this script
from sections import replace_section  # bench/sections.py, beside this script

from peakledger.analysis.allocator_replay import replay_entries
from peakledger.simulator.allocator import AllocatorConfig
from peakledger.simulator.torch_rules import nearest

SECTION = "## GPU allocator: every real snapshot under the rules of the torch that recorded it"
DEFAULT_SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "gpu-truth"
RECORDED_BY = {"snapshots": "2.6.0", "h200": "2.11.0+cu130"}  # the folders' READMEs (module docstring)


def snapshots(shared: Path) -> list[tuple[Path, str]]:
    """(file, the torch that recorded it) for every snapshot under `shared`, in a stable order."""
    out = []
    for folder, torch in RECORDED_BY.items():
        for path in sorted((shared / folder).rglob("*.pickle*")):
            out.append((path, torch))
    return out


def row(path: Path, shared: Path, torch: str) -> dict:
    rules = nearest(torch)
    raw = read_raw_snapshot(path)
    n = max(len(raw.get("device_traces", [])), 1)
    devices = [replay_entries(raw, d, AllocatorConfig.parse("", rules.version)) for d in range(n)]
    d0 = devices[0]
    return {"snapshot": str(path.relative_to(shared)), "torch": torch, "rules": rules.version,
            "trace_events": d0["trace_events"], "segments_measured": d0["segments_measured"],
            "segments_matched": d0["segments_matched"], "reserved_exact_fraction": d0["reserved_exact_fraction"],
            "final_layout_matches": d0["final_layout_matches"], "reserved_peak": d0["reserved_peak"],
            "exact": all(d["segments_matched"] == d["segments_measured"] and d["reserved_exact_fraction"] == 1.0
                         and d["final_layout_matches"] for d in devices)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write", action="store_true", help=f"write '{SECTION[3:]}' into bench/VALIDATION.md")
    args = ap.parse_args(argv)
    found = snapshots(args.shared)
    if not found:
        print(f"no snapshots under {args.shared}", file=sys.stderr)
        return 2
    rows = [row(p, args.shared, t) for p, t in found]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    gib = 1 << 30
    lines = ["| snapshot | recorded by torch | rules | trace events | segments matched / measured | reserved peak "
             "measured / predicted (GiB) | reserved exact | final layout |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['snapshot']} | {r['torch']} | {r['rules']} | {r['trace_events']:,} | "
                     f"{r['segments_matched']} / {r['segments_measured']} | {r['reserved_peak']['measured'] / gib:.3f}"
                     f" / {r['reserved_peak']['predicted'] / gib:.3f} | {r['reserved_exact_fraction']:.4f} | "
                     f"{'same' if r['final_layout_matches'] else 'differs'} |")
    exact = sum(r["exact"] for r in rows)
    by = {v: sum(r["rules"] == v for r in rows) for v in dict.fromkeys(r["rules"] for r in rows)}
    head = (f"{exact} of {len(rows)} snapshots equal in every segment event, the reserved bytes after every event and "
            f"the final layout ({', '.join(f'{n} under torch {v} rules' for v, n in by.items())}).")
    print(head)
    print("\n".join(lines))
    if args.write:
        replace_section(SECTION, "\n".join([
            SECTION, "",
            "`python bench/validate_torch_rules.py --write`: every snapshot of ../shared/gpu-truth replayed through "
            "the allocator model (as `peakledger replay` does) with the settings parsed under the rule set of the "
            "torch "
            "that recorded it (simulator/torch_rules: snapshots/ torch 2.6.0, h200/ torch 2.11.0+cu130, from the "
            "folders' READMEs). No snapshot was recorded under torch 2.13 (../shared/gpu-truth/PENDING.md item 2): "
            "2.13's rules are checked against torch 2.13.0's own settings parser (tests/test_torch_rules.py) and its "
            "source (docs/gpu.md, \"What changed between torch 2.11 and 2.13\"), not against a recording. "
            f"**{head}**", "", *lines, ""]))
        print(f"wrote {SECTION[3:]!r} into bench/VALIDATION.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
