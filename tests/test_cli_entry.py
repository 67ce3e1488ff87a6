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
