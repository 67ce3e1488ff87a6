"""The `peakledger` command (peakledger/cli.py `entry`): main()'s status and whole output, the exit functions run
(atexit), then the exit without the interpreter's teardown; the ordinary exit where a non-daemon thread runs."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, sys, threading, time
from peakledger.cli import entry
if sys.argv[1] == "none":
    sys.argv.pop(1)
atexit.register(lambda: print("exit functions ran", file=sys.stderr))
if sys.argv[1] == "thread":
    sys.argv.pop(1)
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", file=sys.stderr))).start()
entry()
"""


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, *argv], capture_output=True, text=True)


def test_status_output_and_exit_functions():
    ok = _run("none", "simulate", "--json")
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("}") and "exit functions ran" in ok.stderr
    bad = _run("none", "simulate", "--micro-batch", "0")
    assert bad.returncode == 2 and "micro_batch" in bad.stderr and "exit functions ran" in bad.stderr


def test_a_running_thread_is_waited_for():
    p = _run("thread", "simulate", "--json")
    assert p.returncode == 0 and "thread done" in p.stderr and "exit functions ran" in p.stderr


KEPT = """
import gc, sys, weakref
import peakledger.cmd_simulate as cs
from peakledger import cli, kept
made = []
real = cs.api.run
cs.api.run = lambda *a, **k: (made.append(real(*a, **k)), made[-1])[1]
if sys.argv.pop(1) == "entry":
    kept.keeping()  # (as cli.entry does)
cli.main(["simulate", "--json"])
report = weakref.ref(made.pop())
gc.collect()
print("kept" if report() is not None else "freed", file=sys.stderr)
"""


def test_under_the_command_a_run_is_kept_until_the_exit_and_elsewhere_freed():
    # (peakledger/kept.py: os._exit frees nothing, so freeing a big run object by object is work for nobody)
    for how, expected in (("entry", "kept"), ("main", "freed")):
        p = subprocess.run([sys.executable, "-c", KEPT, how], capture_output=True, text=True)
        assert p.returncode == 0 and p.stderr.strip().splitlines()[-1] == expected, p.stderr[-2000:]
