"""peakledger's prediction beside each peak run_cases.py measured on a GPU (issue 38's cases); runs on a CPU.

    python bench/gpu_issue38/compare.py DIR [--only NAME,NAME] [--device PROFILE] [--torch-version 2.11] [--json]

DIR holds run_cases.py's results.json and snapshots.tar.gz (as they came back from $OUT, or the folder committed
under ../shared/gpu-truth/). Each measured case is predicted through peakledger.api (`build_scenario` with the
case's training table from cases.py, each describer cases.py lists for it; the config written as config.json), on
the GPU profile of the card that ran it (H100 -> H100-80GB, H200 -> H200-141GB, or --device) with the allocator
rules of the torch that ran (bench/validate_gpu.py `allocator_rules`, or --torch-version). Printed per case:
- per phase of the last step (steady state) and the whole run: measured `max_memory_allocated` /
  `max_memory_reserved` against the prediction's phase peaks (report_json "phases": tensor bytes; the measured
  allocated counts blocks, requests rounded up to 512 B, so it is a little above a perfect prediction; a measured
  phase peak includes what is live when the phase starts (`reset_peak_memory_stats()` sets the peak to the bytes
  allocated then), a predicted one is the highest after the phase's first event: zero_grad, which only frees,
  reads lower predicted than measured by the gradients it frees);
- from the snapshot (bench/gpu_snapshots.py, bench/validate_gpu.py `compare_run`): the allocated peak in requested
  bytes and the reserved peak, measured / predicted, and the allocations paired by size;
- the host: torch's pinned host allocator peak measured (torch.cuda.host_memory_stats, where the torch has it)
  beside the prediction's pinned host peak (report_json "host_memory"), and the predicted host peak.
A case no describer models (cases.py `describers` empty, e.g. FSDP2 CPUOffloadPolicy on one GPU) is shown
measured only, with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # bench/: gpu_snapshots.py, validate_gpu.py
from cases import CASES, LLAMA_3_2_1B, TORCH_RULES, command_of, training_of  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "zero_grad")
PROFILES = {"H100": "H100-80GB", "H200": "H200-141GB", "A100": "A100-80GB"}


def profile_of(gpu: str | None) -> str | None:
    return next((p for k, p in PROFILES.items() if gpu and k in gpu), None)


def rules_of(torch_version: str | None) -> str:
    if not torch_version:
        return TORCH_RULES
    from validate_gpu import allocator_rules
    return allocator_rules(torch_version)


def measured_phases(res: dict) -> dict:
    """(step, phase) -> {"allocated", "reserved"} measured, step 0 "load" = what building left."""
    out = {}
    b = res.get("after_build", {})
    if "peak_allocated" in b:
        out[(0, "load")] = {"allocated": b["peak_allocated"], "reserved": b["peak_reserved"]}
    for i, rows in enumerate(res.get("steps_measured", []), start=1):
        for ph in PHASES:
            r = rows.get(ph, {})
            if "peak_allocated" in r:
                out[(i, ph)] = {"allocated": r["peak_allocated"], "reserved": r["peak_reserved"]}
    return out


def pinned_peak(res: dict) -> int | None:
    """The highest pinned-host-allocator byte count any phase read (torch.cuda.host_memory_stats)."""
    best = None
    rows = [res.get("after_build", {})] + [r for s in res.get("steps_measured", []) for r in s.values()]
    for r in rows:
        pinned = r.get("host", {}).get("pinned")
        if isinstance(pinned, dict):
            for k, v in pinned.items():
                if "allocated" in k and ("peak" in k or "current" in k):
                    best = max(best or 0, v)
    return best


def predict(name: str, device: str, rules: str, describer: str, workdir: Path):
    from peakledger import api
    from peakledger.analysis.report import report_json
    from peakledger.scenario import build_scenario

    path = workdir / "llama-3.2-1b.json"
    path.write_text(json.dumps(LLAMA_3_2_1B))
    scenario = build_scenario({"hf_config": str(path), "describer": describer}, training_of(name),
                              {"device": device, "torch_version": rules}, name=name)
    report = api.run(scenario)
    return report, report_json(report)


def _order(key: tuple) -> tuple:
    step, phase = key
    return step, PHASES.index(phase) if phase in PHASES else -1


def err(m, p) -> float | None:
    return None if not m or p is None else (p - m) / m


def compare_case(name: str, res: dict, snapshots: Path, device: str, rules: str, workdir: Path) -> dict:
    case = CASES[name]
    measured = measured_phases(res)
    out = {"case": name, "measured_phases": {f"{s}:{p}": v for (s, p), v in measured.items()},
           "measured_pinned_peak": pinned_peak(res), "predictions": []}
    if not case["describers"]:
        out["note"] = "not predicted: " + (case["cuda"] or "no describer models it")
        return out
    snap = snapshots / f"{name}.pickle.gz"
    trace = None
    if snap.exists():
        from gpu_snapshots import read_snapshot
        trace = read_snapshot(snap)
    for describer in case["describers"]:
        row = {"describer": describer, "command": command_of(name, describer, device=device)}
        try:
            report, js = predict(name, device, rules, describer, workdir)
        except Exception as e:  # noqa: BLE001  (a refused knob: its one-line message)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            out["predictions"].append(row)
            continue
        phases = {(p["step"], p["phase"]): {"allocated": p["allocated"], "reserved": p["reserved"]}
                  for p in js["phases"]}
        row["phases"] = {f"{s}:{p}": {"measured": measured.get((s, p)), "predicted": phases.get((s, p))}
                         for (s, p) in sorted(set(measured) | set(phases), key=_order)}
        m_all = max((v["allocated"] for v in measured.values()), default=None)
        m_res = max((v["reserved"] for v in measured.values()), default=None)
        row["overall"] = {"measured_allocated": m_all, "predicted_allocated": js["peak"]["bytes"],
                          "measured_reserved": m_res,
                          "predicted_reserved": (js.get("reserved_peak") or {}).get("bytes")}
        row["host"] = {"predicted_host_peak": (js.get("host_peak") or {}).get("bytes"),
                       "predicted_host_memory": js.get("host_memory")}
        if trace is not None:
            from validate_gpu import compare_run
            c = compare_run(trace, report)
            row["snapshot"] = {k: c[k] for k in ("measured", "predicted", "error", "events") if k in c}
        out["predictions"].append(row)
    return out


def gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.3f}"


def pct(m, p) -> str:
    e = err(m, p)
    return "-" if e is None else f"{e:+.2%}"


def print_case(c: dict, steps: int) -> None:
    print(f"\n== {c['case']}")
    if "note" in c:
        last = {k: v for k, v in c["measured_phases"].items() if k.startswith(f"{steps}:")}
        print(f"  {c['note']}; measured step {steps} (allocated/reserved GiB): "
              + ", ".join(f"{k.split(':')[1]} {gib(v['allocated'])}/{gib(v['reserved'])}" for k, v in last.items()))
        return
    for row in c["predictions"]:
        print(f"  [{row['describer']}] {row['command']}")
        if "error" in row:
            print(f"    not predicted: {row['error']}")
            continue
        print("    phase                 alloc meas / pred GiB   err       reserved meas / pred GiB   err")
        for key, v in row["phases"].items():
            s, ph = key.split(":")
            if int(s) not in (0, steps):
                continue
            m, p = v["measured"] or {}, v["predicted"] or {}
            print(f"    {('step ' + s + ' ' + ph) if s != '0' else 'load':<20} {gib(m.get('allocated')):>8} / "
                  f"{gib(p.get('allocated')):<8} {pct(m.get('allocated'), p.get('allocated')):>8}   "
                  f"{gib(m.get('reserved')):>8} / {gib(p.get('reserved')):<8} "
                  f"{pct(m.get('reserved'), p.get('reserved')):>8}")
        o = row["overall"]
        print(f"    whole run: allocated {gib(o['measured_allocated'])} / {gib(o['predicted_allocated'])} GiB "
              f"({pct(o['measured_allocated'], o['predicted_allocated'])}), reserved "
              f"{gib(o['measured_reserved'])} / {gib(o['predicted_reserved'])} GiB "
              f"({pct(o['measured_reserved'], o['predicted_reserved'])})")
        sn = row.get("snapshot")
        if sn and "predicted" in sn:
            ev = sn.get("events", {}).get("reserved", {})
            m, p = sn["measured"], sn["predicted"]
            print(f"    snapshot (requested bytes): allocated {m['allocated']:,} / "
                  f"{p['allocated']:,} B ({pct(m['allocated'], p['allocated'])})"
                  f", reserved {sn['measured']['reserved']:,} / {sn['predicted']['reserved']:,} B "
                  f"({pct(sn['measured']['reserved'], sn['predicted']['reserved'])}); reserved after paired allocs "
                  f"equal {ev.get('equal')} / within 2% {ev.get('within_2pct')} / "
                  f"{sn.get('events', {}).get('compared')}")
        h = row["host"]
        hm = h.get("predicted_host_memory") or {}
        print(f"    host: pinned peak measured {gib(c['measured_pinned_peak'])} GiB, predicted pinned "
              f"{gib(hm.get('pinned_peak'))} GiB; predicted host peak {gib(h['predicted_host_peak'])} GiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--only")
    ap.add_argument("--device", help="peakledger GPU profile (default: from the recorded GPU's name)")
    ap.add_argument("--torch-version", help="allocator rules (default: from the recorded torch)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    folder = Path(a.dir)
    results = json.loads((folder / "results.json").read_text())
    cases = {n: r for n, r in results["cases"].items() if n in CASES and (not a.only or n in a.only.split(","))}
    first = next((r for r in cases.values() if "gpu" in r), {})
    device = a.device or profile_of(first.get("gpu")) or "H100-80GB"
    rules = a.torch_version or rules_of((first.get("versions") or {}).get("torch"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        snaps = folder / "snapshots"
        if not snaps.is_dir() and (folder / "snapshots.tar.gz").exists():
            snaps = tmp / "snapshots"
            with tarfile.open(folder / "snapshots.tar.gz") as tar:
                tar.extractall(snaps, filter="data")
        rows = []
        for name, res in cases.items():
            if "steps_measured" not in res:
                rows.append({"case": name, "not_measured": res.get("skipped") or res.get("error")})
                continue
            rows.append(compare_case(name, res, snaps, device, rules, tmp))
    if a.json:
        print(json.dumps({"device": device, "torch_rules": rules, "gpu": first.get("gpu"),
                          "versions": first.get("versions"), "rows": rows}, indent=1))
        return 0
    print(f"recorded on {first.get('gpu')} ({(first.get('versions') or {}).get('nvidia_smi')}), torch "
          f"{(first.get('versions') or {}).get('torch')}; predicted on {device} with torch {rules}'s allocator rules")
    steps = results.get("steps", 3)
    for c in rows:
        if "not_measured" in c:
            print(f"\n== {c['case']}: not measured ({c['not_measured']})")
        else:
            print_case(c, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
