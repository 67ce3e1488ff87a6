"""How fast `peakledger simulate --hf-config` answers cold (empty trace cache) and warm (models/traced/store.py: the
recording read from disk, neither torch nor transformers imported), beside torch's MemTracker under FakeTensorMode
on the same model and step. Writes the "Trace cache: cold and warm" section of bench/RESULTS.md (appended, or
replaced where it is there).

    python bench/warm_cache_speed.py                 # print (5 pairs of runs each)
    python bench/warm_cache_speed.py --runs 7 --write

The model: examples/hf-llama-3-8b/config.json (Llama-3-8B); the step: micro-batch 1, seq 2048, pure bf16
(`--precision bf16`, as MemTracker's model is built with `dtype=torch.bfloat16`), AdamW, `--device cpu`. Every
figure is a whole process, timed from its start to its exit (wall clock; CPU = the child's user + system time),
and each comparison runs its two commands in turn, A B A B ..., the ratio taken pair by pair, the median quoted:
- cold: `peakledger simulate ...` with the trace cache emptied before each run (the imports of transformers and
  torch, the traces of 3 and 4 layers, the simulation), against MemTracker;
- warm: the same model again with a setting the recording does not follow (`--optimizer sgd`), the cache primed
  once, against MemTracker;
- second call, another micro-batch: micro-batch 2, then 6, where the cache holds what the cold call at micro-batch
  1 left (emptied and primed by that call before each run): its recording and those of sizes 2, 3 and 4 that
  `simulate`'s first trace records beside it (models/traced `micro_batch_points`), from which scale.py derives
  any other size: 2 against MemTracker, 6 against the warm run.
- the imports alone: a new Python that imports torch and transformers' LlamaForCausalLM, and nothing else (what a
  cold call, which runs transformers' code, cannot go below), beside the cold call;
- with a server up (`peakledger serve`, peakledger/serve: torch, transformers and peakledger imported once, each
  command run in a fork of it): cold, warm and the second call at micro-batch 2 again, each against MemTracker,
  the client made to use it (PEAKLEDGER_SERVER=require); the server's own start (`serve --background`, until it
  takes commands) timed once. The rows above run without one (PEAKLEDGER_SERVER=off);
- MemTracker: a new Python that imports torch and transformers, builds the model under FakeTensorMode
  (`no_init_weights`, bf16) and runs one forward, backward and AdamW step inside
  `torch.distributed._tools.mem_tracker.MemTracker`: bench/memtracker_step.py, the program bench/traced_speed.py
  times by stage, here run whole at this step's sizes.
peakledger's own modules are compiled first (`compileall`), as a wheel install ships them: under
PYTHONDONTWRITEBYTECODE an editable checkout would otherwise compile some 400 modules from source in every run.
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "examples", "hf-llama-3-8b", "config.json")
FLAGS = ["--precision", "bf16", "--micro-batch", "1", "--seq-len", "2048", "--device", "cpu"]
WARM_FLAGS = ["--optimizer", "sgd"]  # SGD instead of AdamW: no trace follows the optimizer (store.py key)
SECTION = "## Trace cache: cold and warm"
RESULTS = os.path.join(HERE, "RESULTS.md")

MEMTRACKER = os.path.join(HERE, "memtracker_step.py")  # torch and transformers only: a whole process


def peakledger(config: str, *flags: str) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "peakledger")
    return [exe, "simulate", "--hf-config", config, *flags]


def memtracker(config: str, seq_len: str) -> list[str]:
    return [sys.executable, MEMTRACKER, config, "1", seq_len]


def timed(cmd: list[str], env: dict, before=None) -> dict:
    """One whole process: wall seconds from its start to its exit, and its CPU seconds (user + system)."""
    if before is not None:
        before()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"wall": wall, "cpu": cpu, "stdout": proc.stdout}


def pairs(a: list[str], b: list[str], env: dict, runs: int, before_a=None) -> dict:
    """A and B in turn, `runs` times each after one warm-up pair; medians, and the A/B ratio pair by pair."""
    timed(a, env, before_a)
    timed(b, env)
    ta, tb = [], []
    for _ in range(runs):
        ta.append(timed(a, env, before_a))
        tb.append(timed(b, env))
    med = statistics.median
    return {"a": med(x["wall"] for x in ta), "b": med(x["wall"] for x in tb),
            "a_cpu": med(x["cpu"] for x in ta), "b_cpu": med(x["cpu"] for x in tb),
            "b_over_a": med(y["wall"] / x["wall"] for x, y in zip(ta, tb)),
            "a_range": (min(x["wall"] for x in ta), max(x["wall"] for x in ta)),
            "b_range": (min(x["wall"] for x in tb), max(x["wall"] for x in tb)), "a_out": ta[-1]["stdout"],
            "b_out": tb[-1]["stdout"]}


IMPORTS = "import torch; from transformers import LlamaForCausalLM"  # what a cold call cannot go below


def render(cold: dict, warm: dict, second: dict, derived: dict, floor: dict, served: dict, runs: int,
           note: str) -> str:
    def row(name, cmd, w, other, ratio, which="a"):
        lo, hi = w[f"{which}_range"]
        cpu = f"{w[f'{which}_cpu']:.2f} s" + (" (the client's)" if "server" in name else "")
        return f"| {name} | `{cmd}` | **{w[which]:.2f} s** ({lo:.2f}-{hi:.2f}) | {cpu} | {other} | {ratio} |"

    flags = " ".join(FLAGS)
    return "\n".join([
        SECTION, "",
        f"`python bench/warm_cache_speed.py --runs {runs} --write` on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}{note}. Whole processes, medians of {runs} runs (min-max); each pair of "
        "commands run in turn and the ratio taken pair by pair (bench/warm_cache_speed.py says how). Model: "
        f"examples/hf-llama-3-8b/config.json; step: `{flags}`.", "",
        "| run | command | wall | CPU | compared with (same call) | MemTracker / this |",
        "|---|---|---:|---:|---|---:|",
        row("cold (empty cache)", f"peakledger simulate --hf-config CONFIG {flags}", cold,
            f"MemTracker {cold['b']:.1f} s", f"**{cold['b_over_a']:.1f}x**"),
        row("warm (another setting)", f"... {' '.join(WARM_FLAGS)}", warm, f"MemTracker {warm['b']:.1f} s",
            f"**{warm['b_over_a']:.1f}x**"),
        row("second call, micro-batch 2 (after the cold call)", "... --micro-batch 2", second,
            f"MemTracker {second['b']:.1f} s", f"**{second['b_over_a']:.1f}x**"),
        row("second call, micro-batch 6 (after the cold call)", "... --micro-batch 6", derived,
            f"warm {derived['b']:.2f} s", f"{cold['b'] / derived['a']:.1f}x (cold's MemTracker runs)"),
        row("cold, a server up", "PEAKLEDGER_SERVER=require peakledger simulate ...", served["cold"],
            f"MemTracker {served['cold']['b']:.1f} s", f"**{served['cold']['b_over_a']:.1f}x**"),
        row("warm, a server up", f"... {' '.join(WARM_FLAGS)}", served["warm"],
            f"MemTracker {served['warm']['b']:.1f} s", f"**{served['warm']['b_over_a']:.1f}x**"),
        row("second call, micro-batch 2, a server up", "... --micro-batch 2", served["second"],
            f"MemTracker {served['second']['b']:.1f} s", f"**{served['second']['b_over_a']:.1f}x**"),
        f"| the server's start (once) | `peakledger serve --background` | {served['start']:.2f} s | | "
        "until it takes commands | |",
        row("MemTracker, FakeTensorMode", "python bench/memtracker_step.py CONFIG 1 2048", cold, "cold", "1x",
            which="b"),
        row("the imports alone (a cold call's floor)", f"python -c '{IMPORTS}'", floor,
            f"cold {floor['a']:.2f} s", f"{cold['b'] / floor['b']:.1f}x (cold's MemTracker runs)", which="b"),
        "",
        "With a server up each command printed what it printed in its own process (checked); the CPU of a command "
        "run there is the server's fork's, not counted in the client's. "
        "A warm run and a second call at another micro-batch import neither torch nor transformers "
        "(tests/test_trace_cache.py, tests/test_micro_batch_points.py check it); a micro-batch whose program is "
        "neither in the cache nor derivable from it is traced, as cold.", ""])


def primer(run, flags: list[str], env: dict, empty):
    """Before a second call: the cache emptied, then primed by the cold call at micro-batch 1."""
    def primed_with_one():
        empty()
        timed(run(*flags), env)
    return primed_with_one


def calls(run, flags: list[str], mt: list[str], env: dict, runs: int, empty, label: str = "") -> dict:
    """Cold, warm and the second call at micro-batch 2, each against MemTracker, under `env`."""
    out = {"cold": pairs(run(*flags), mt, env, runs, before_a=empty)}
    timed(run(*flags), env)  # primes the cache
    out["warm"] = pairs(run(*flags, *WARM_FLAGS), mt, env, runs)
    out["second"] = pairs(run(*flags[:2], "--micro-batch", "2", *flags[4:]), mt, env, runs,
                          before_a=primer(run, flags, env, empty))
    for name, w in out.items():
        print(f"{label}{name}: {w['a']:.2f}s, MemTracker {w['b']:.2f}s: {w['b_over_a']:.1f}x", flush=True)
    return out


def with_server(run, flags: list[str], mt: list[str], env: dict, runs: int, empty) -> dict:
    """`calls` with a server up (the client made to use it); the server's start."""
    serve = [os.path.join(os.path.dirname(sys.executable), "peakledger"), "serve"]
    start = timed([*serve, "--background"], {**env, "PEAKLEDGER_SERVER": "auto"})["wall"]
    print(f"server started in {start:.2f}s", flush=True)
    try:
        return {"start": start, **calls(run, flags, mt, {**env, "PEAKLEDGER_SERVER": "require"}, runs, empty,
                                        "served: ")}
    finally:
        subprocess.run([*serve, "--stop"], env=env, stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    ap.add_argument("--note", default="", help="a few words on the machine's load, put after its description")
    ap.add_argument("--config", default=CONFIG, help="a Llama config.json (default: the Llama-3-8B's); --write "
                    "needs the default")
    ap.add_argument("--seq-len", default="2048")
    args = ap.parse_args()
    if args.write and (args.config != CONFIG or args.seq_len != "2048"):
        raise SystemExit("--write: only the default model and sequence length")
    flags = ["--precision", "bf16", "--micro-batch", "1", "--seq-len", args.seq_len, "--device", "cpu"]
    run = lambda *f: peakledger(args.config, *f)  # noqa: E731
    mt = memtracker(args.config, args.seq_len)
    if args.runs < 5:
        raise SystemExit("--runs: at least 5")
    for folder in ("peakledger", "models", "simulator", "traces", "analysis"):
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=1)
    cache = tempfile.mkdtemp(prefix="peakledger-bench-cache-")
    env = {**os.environ, "PEAKLEDGER_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore", "PEAKLEDGER_SERVER": "off"}
    sockets = tempfile.mkdtemp(prefix="plb-")

    def empty():
        shutil.rmtree(cache, ignore_errors=True)

    try:
        alone = calls(run, flags, mt, env, args.runs, empty)
        cold, warm, second = alone["cold"], alone["warm"], alone["second"]
        derived = pairs(run(*flags[:2], "--micro-batch", "6", *flags[4:]), run(*flags, *WARM_FLAGS), env,
                        args.runs, before_a=primer(run, flags, env, empty))
        print(f"micro-batch 6 after 1 {derived['a']:.2f}s, warm {derived['b']:.2f}s", flush=True)
        floor = pairs(run(*flags), [sys.executable, "-c", IMPORTS], env, args.runs, before_a=empty)
        print(f"cold {floor['a']:.2f}s, the imports alone {floor['b']:.2f}s", flush=True)
        served = with_server(run, flags, mt, {**env, "PEAKLEDGER_SERVER_DIR": sockets}, args.runs, empty)
        if served["cold"]["a_out"] != cold["a_out"] or served["warm"]["a_out"] != warm["a_out"]:
            raise SystemExit("a command on the server printed other than in its own process")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)
    section = render(cold, warm, second, derived, floor, served, args.runs, f"; {args.note}" if args.note else "")
    print()
    print(section)
    if args.write:
        sys.path.insert(0, HERE)
        from sections import replace_section  # bench/sections.py

        replace_section(SECTION, section, RESULTS)
        print("wrote the section into bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
