"""Issue 39's must-show speeds: each command as a user runs it, whole process (start-up and imports included), the
median of --runs runs (default 5, after one warm-up), each beside a baseline command when --baseline names another
install's `peakledger` (A and B run in turn, A B A B ..., the ratio taken pair by pair as farm-bench does). Writes
the "Issue 39: speed" section of bench/RESULTS.md with --write (the other sections are kept).

    python bench/speed_39.py                                   # print
    python bench/speed_39.py --baseline /work/main/.venv/bin/peakledger --write
    python bench/speed_39.py --only r2048 explain-8b --runs 7

Cases (targets of issue 39, on a quiet 2-core machine):
- r2048: Llama-3-70B, TP 8 x PP 8 (interleaved 1F1B, v 2) x DP 32 on 2,048 GPUs, 32 micro-batches, full AC: < 5 s;
- 405b-16k: Llama 3.1 405B on 16,384 GPUs as bench/scale_parallel.py runs it (TP 8 x PP 16 x DP 128, ZeRO-1,
  interleaved 1F1B v 2, 16 micro-batches of 1 x 8192, full AC, sequence parallel): < 5 s;
- explain-8b: the README's `explain` of Llama-3-8B on one H100: < 8 s;
- explain-save: the README's save scenario (FSDP2 on 8 GPUs, a full-rank0 save) against 80 GiB;
- default: `peakledger simulate`;
- api (with --api; needs transformers): docs/models.md's Python example (a traced Gemma-2 2B, run, max-batch,
  explain), each run with an empty trace cache of its own (a first run): < 20 s, its peak memory beside.
Every command runs in its own process (PEAKLEDGER_SERVER=off); with --server, this checkout's on a server started
for the measurement (`peakledger serve --background`, PEAKLEDGER_SERVER=require; the baseline as before; not the
Python example, which is no command).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sections import replace_section  # bench/sections.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
HEADING = "## Issue 39: speed"
API_EXAMPLE = '''import peakledger as pl
sc = pl.trace(hf_config={"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "head_dim": 256, "vocab_size": 256000},
              micro_batch=2, seq_len=2048, precision="bf16-mixed", checkpointing="full")
report = pl.run(sc)
print(report.peaks.overall.bytes, report.metadata.describer)
print(pl.max_micro_batch(sc, 80 << 30))
print([f.name for f in pl.explain(sc, 24 << 30).fixes][:3])
'''
CASES: dict[str, tuple[list[str], float | None]] = {  # name -> (peakledger arguments, target seconds)
    "r2048": (["simulate", "--preset", "llama-3-70b", "--tp", "8", "--pp", "8", "--pp-schedule", "interleaved-1f1b",
               "--virtual-stages", "2", "--grad-accum", "32", "--world-size", "2048", "--checkpointing", "full",
               "--json"], 5.0),
    "405b-16k": (["simulate", "--preset", "llama-3.1-405b", "--world-size", "16384", "--tp", "8", "--pp", "16",
                  "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2", "--grad-accum", "16", "--zero-stage",
                  "1", "--checkpointing", "full", "--sequence-parallel", "--micro-batch", "1", "--seq-len", "8192",
                  "--precision", "bf16-mixed", "--json"], 5.0),
    "explain-8b": (["explain", "--preset", "llama-3-8b", "--precision", "bf16-mixed", "--micro-batch", "1",
                    "--seq-len", "2048", "--device", "H100-80GB"], 8.0),
    "explain-save": (["explain", "--scenario", "examples/llama-3-8b-fsdp2-save.toml", "--budget", "80GiB"], None),
    "default": (["simulate"], None),
}


def once(argv: list[str], cold: bool = False, env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB of the process) of one run, from its start to its exit; `cold`: with an empty
    trace cache of its own (models/traced/store.py), as a user's first run; `env`: its environment (default:
    this one's, PEAKLEDGER_SERVER=off)."""
    env = {**os.environ, "PEAKLEDGER_SERVER": "off"} if env is None else dict(env)
    with tempfile.TemporaryDirectory(prefix="peakledger-speed39-") as cache:
        if cold:
            env["PEAKLEDGER_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        # (the example runs in the empty folder: from this checkout's root, `import peakledger` of another install
        # would read this checkout's peakledger/ first, Python putting the working folder first on its path)
        child = subprocess.Popen(argv, cwd=cache if cold else ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode not in (0, 1):
        raise RuntimeError(f"exit {child.returncode}: {' '.join(argv)}")
    return wall, usage.ru_maxrss / 1024


def argv_of(exe: str, case: str) -> list[str]:
    if case == "api":
        return [str(Path(exe).with_name("python")), "-c", API_EXAMPLE]
    return [exe, *CASES[case][0]]


def measure(case: str, exe: str, baseline: str | None, runs: int, env: dict | None = None) -> dict:
    a, b = argv_of(exe, case), argv_of(baseline, case) if baseline else None
    cold = case == "api"  # the example traces: each run with an empty trace cache, as a first run
    once(a, cold, env)  # warm-up (the file cache), not counted
    walls, peaks, ratios, base = [], [], [], []
    for _ in range(runs):
        wall, peak = once(a, cold, env)
        walls.append(wall)
        peaks.append(peak)
        if b is not None:
            w, _ = once(b, cold)
            base.append(w)
            ratios.append(wall / w)
    return {"median": statistics.median(walls), "min": min(walls), "max": max(walls), "peak": max(peaks),
            "baseline": statistics.median(base) if base else None,
            "ratio": statistics.median(ratios) if ratios else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline", help="another install's peakledger executable, run beside each case")
    ap.add_argument("--only", nargs="*", help="these cases only")
    ap.add_argument("--api", action="store_true", help="also docs/models.md's Python example (needs transformers)")
    ap.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    ap.add_argument("--server", action="store_true", help="this checkout's commands on a server (peakledger serve)")
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("peakledger"))
    names = [n for n in [*CASES, *(["api"] if args.api and not args.server else [])]
             if not args.only or n in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pls-") as sockets:
        env = None
        if args.server:
            env = {**os.environ, "PEAKLEDGER_SERVER_DIR": sockets}
            subprocess.run([exe, "serve", "--background"], env={**env, "PEAKLEDGER_SERVER": "off"}, check=True,
                           stdout=subprocess.DEVNULL)
            env["PEAKLEDGER_SERVER"] = "require"
        try:
            rows = _rows(names, exe, args, env)
        finally:
            if args.server:
                subprocess.run([exe, "serve", "--stop"], env=env, stdout=subprocess.DEVNULL)
    head = ("| command | median wall (min .. max) | peak RSS | baseline median | ratio (median of pairs) | "
            "target |\n|---|---|---|---|---|---|\n")
    heading = "## Issue 39 on a server: speed" if args.server else HEADING
    section = (f"{heading}\n\nbench/speed_39.py{' --server' if args.server else ''}, {args.runs} runs each after a "
               f"warm-up, whole process, on {platform.node()} ({os.cpu_count()} cores), Python "
               f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}"
               + (f"; baseline: {args.baseline}" if args.baseline else "")
               + ("; the commands on a server started for the measurement, the baseline each in its own process"
                  if args.server else "") + ".\n\n"
               + head + "\n".join(rows) + "\n")
    if args.write:
        replace_section(heading, section, str(RESULTS))
    return 0


def _rows(names: list[str], exe: str, args, env: dict | None) -> list[str]:
    rows = []
    for name in names:
        m = measure(name, exe, args.baseline, args.runs, env)
        target = 20.0 if name == "api" else CASES[name][1]
        cmd = "python -c <docs/models.md example>" if name == "api" else "peakledger " + " ".join(CASES[name][0])
        rss = "- (on the server)" if env is not None else f"{m['peak']:.0f} MiB"  # (the client's own is no measure)
        line = (f"| `{cmd}` | {m['median']:.2f} s ({m['min']:.2f} .. {m['max']:.2f}) | {rss} | "
                + (f"{m['baseline']:.2f} s | {m['ratio']:.2f} | " if m["ratio"] is not None else "- | - | ")
                + (f"< {target:.0f} s: {'yes' if m['median'] < target else 'no'} |" if target else "- |"))
        print(line, flush=True)
        rows.append(line)
    return rows


if __name__ == "__main__":
    sys.exit(main())
