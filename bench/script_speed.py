"""How fast `peakledger run` predicts a big training script, beside torch's MemTracker on the same script.

The script: examples/scripts/hf_trainer_clm.py (HF Trainer, run_clm-style) on a Llama-3-8B config
(examples/hf-llama-3-8b), micro-batch 1, seq 2048, bf16 mixed precision, AdamW, one optimizer step (MemTracker
refuses a module called twice: "does not support memory tracking for multiple iterative calls"), no eval.

    python bench/script_speed.py              # both, each in a fresh process, timed from process start
    python bench/script_speed.py --write      # also replace the section in bench/RESULTS.md

- peakledger: `peakledger run hf_trainer_clm.py -- ARGS`, the whole command (the fake run, the
  simulation, the report).
- MemTracker: torch.distributed._tools.mem_tracker.MemTracker (torch's memory tracker, which runs on fake
  tensors) around the same script under FakeTensorMode. Run as it is (`with FakeTensorMode(), MemTracker():
  runpy.run_path(script)`) it fails; the first error is quoted. So it also runs inside peakledger's script world
  (models/script/run.py: the scratch folder, the values fake tensors lack, `module.to` and data pointers on fake
  tensors), MemTracker in place of peakledger's recorder: the same fake run, two trackers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "examples", "scripts", "hf_trainer_clm.py")
ARGS = ["--config", os.path.join(ROOT, "examples", "hf-llama-3-8b", "config.json"), "--seq-len", "2048",
        "--micro-batch", "1", "--grad-accum", "1", "--max-steps", "1", "--eval-steps", "0", "--bf16",
        "--repeat", "8"]
HEADING = "## User scripts: peakledger run speed beside torch's MemTracker"

MEMTRACKER = r'''
import json, runpy, sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
script, world, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = [script, *args]
out = {{}}
if world == "bare":
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), MemTracker() as mt:
            runpy.run_path(script, run_name="__main__")
    except BaseException as e:
        out["error"] = f"{{type(e).__name__}}: {{str(e).splitlines()[0][:200] if str(e) else ''}}"
else:
    from pathlib import Path
    from peakledger.models.script.run import fake_gaps, run_path, saves_counted, script_context
    from peakledger.models.script.phases import StopScript
    from peakledger.models.script.values import Values, numpy_reads
    from peakledger.models.script.record import Recorder
    from peakledger.models.traced.realpath import cpu_fake_kernels, real_code_paths
    from peakledger.models.script.phases import Position, ScriptPhases
    from peakledger.simulator.events import Phase
    values = Values()
    # the values side needs the recorder's dispatch (it answers reads there); MemTracker tracks the memory
    rec = Recorder(values, Position(Phase.LOAD, 0, -1))
    phases = ScriptPhases(None, lambda p: None, lambda m, o: None, lambda t: None, lambda n: None)
    with script_context(Path(script), args):
        with FakeTensorMode(allow_non_fake_inputs=True), fake_gaps(), cpu_fake_kernels(), real_code_paths(), \
                numpy_reads(values), saves_counted(), phases, MemTracker() as mt, rec:
            run_path(Path(script), None)
    peak = mt.get_tracker_snapshot("peak")  # device -> category -> bytes, with the devices' "Total"
    out["peak_bytes"] = peak[torch.device("cpu")]["Total"] if torch.device("cpu") in peak else None
out["seconds"] = time.perf_counter() - start
print(json.dumps(out))
'''


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    peakledger = os.path.join(os.path.dirname(sys.executable), "peakledger")
    seconds, done = timed([peakledger, "run", SCRIPT, "--steps", "0", "--json", "--", *ARGS])
    if done.returncode != 0:
        raise SystemExit(f"peakledger run failed: {done.stderr.strip()[-500:]}")
    report = json.loads(done.stdout)
    ours = {"seconds": seconds, "peak": report["peak"]["bytes"]}
    print(f"peakledger run: {seconds:.1f} s, peak {ours['peak']:,} B")
    code = MEMTRACKER.format(root=ROOT)
    results = {}
    for world in ("bare", "peakledger-world"):
        s, done = timed([sys.executable, "-c", code, SCRIPT, world, *ARGS])
        last = done.stdout.strip().splitlines()[-1:] or ["{}"]
        try:
            results[world] = {**json.loads(last[0]), "wall": s}
        except json.JSONDecodeError:
            results[world] = {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200], "wall": s}
        print(world, results[world])
    mt = results["peakledger-world"]
    ratio = f"{mt['wall'] / seconds:.2f}x" if "error" not in mt else "-"
    lines = ["| run | wall time (s) | peak (B) | note |", "|---|---:|---:|---|",
             f"| peakledger run | {seconds:.1f} | {ours['peak']:,} | the whole command: fake run, simulation, report |",
             f"| MemTracker, FakeTensorMode, the script as it is | {results['bare']['wall']:.1f} | - | "
             f"{results['bare'].get('error', 'ran')} |",
             f"| MemTracker in peakledger's script world | {mt['wall']:.1f} | "
             f"{mt.get('peak_bytes') or 0:,} | {mt.get('error', f'{ratio} peakledger run`s time')} |"]
    text = "\n".join(lines)
    print(text)
    if a.write:
        sys.path.insert(0, HERE)
        from sections import replace_section

        replace_section(HEADING, "\n".join([
            HEADING, "",
            "`python bench/script_speed.py --write` (2 cores; each run a fresh process, timed from its start): "
            "examples/scripts/hf_trainer_clm.py (HF Trainer) on the Llama-3-8B config, "
            f"`{' '.join(ARGS[2:])}`, predicted by `peakledger run --steps 0` (the whole script: its one step), "
            "beside torch's MemTracker "
            "on the same script on fake tensors. MemTracker's peak is what it tracks on the (fake) CPU device; "
            "peakledger's is the simulated peak of the same recording.", "", text, ""]),
            path=os.path.join(HERE, "RESULTS.md"))


if __name__ == "__main__":
    main()
