"""Issue 34, "User code": the cases of bench/hardening_cases_34.py whose --module starts processes or registers
atexit handlers (Case format of bench/hardening_cases.py), all run as real commands. Each process-starting
module records the pid and start time of the process it starts in {tmp}/f.py.pids; the driver `processes_left`
runs the command with its output to files (a process left running would hold a pipe open: the harness's
capture_output would wait for it), notes in {tmp}/running which recorded processes still run once it returned, and
kills them; `_none_running` is the check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

from hardening_cases import Case, _text

RECORD = '''import os
import torch

def record(pid):
    with open(__file__ + ".pids", "a") as f:
        f.write(f"{pid} {open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[19]}\\n")

def built(micro_batch):
    return torch.nn.Linear(8, 8), torch.randn(micro_batch, 8), lambda out: out.sum()
'''

# what a module runs to start a process that would run for 1000 s, its pid recorded
START = {
    "popen": '''
import subprocess
record(subprocess.Popen(["sleep", "1000"]).pid)
''',
    "daemon": '''
import time
r, w = os.pipe()
first = os.fork()
if first == 0:  # a daemon: forked twice, in a session of its own, its parent gone (reparented to init)
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.execvp("sleep", ["sleep", "1000"])
    os._exit(0)
os.close(w)
os.waitpid(first, 0)
daemon = int(os.read(r, 32))
os.close(r)
time.sleep(0.2)  # exec'd meanwhile
record(daemon)
''',
    "multiprocessing": '''
import multiprocessing
import time
p = multiprocessing.Process(target=time.sleep, args=(1000,))  # not a daemon: multiprocessing joins it at exit
p.start()
record(p.pid)
''',
}

def module_text(where: str, code: str) -> str:
    """A module whose import, factory or model's forward runs `code` (once)."""
    body = textwrap.indent(code, "    ")
    if where == "import":
        return RECORD + code + "\n\ndef factory(micro_batch: int = 2):\n    return built(micro_batch)\n"
    if where == "factory":
        return RECORD + f"\n\ndef factory(micro_batch: int = 2):\n{body}\n    return built(micro_batch)\n"
    return RECORD + f'''

class Model(torch.nn.Linear):
    started = False

    def forward(self, x):
        if not Model.started:
            Model.started = True
{textwrap.indent(code, "            ")}
        return super().forward(x)

def factory(micro_batch: int = 2):
    return Model(8, 8), torch.randn(micro_batch, 8), lambda out: out.sum()
'''

def running(pid: int, start: int) -> bool:
    """Whether process `pid`, started at `start` (ticks since boot), still runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[19]) == start and fields[0] not in "ZX"

def recorded(module) -> list[tuple[int, int]]:
    path = f"{module}.pids"
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(a), int(b)) for a, b in (line.split() for line in f if line.strip())]

POPEN_FACTORY = module_text("factory", START["popen"])
DAEMON_FACTORY = module_text("factory", START["daemon"])
MP_FACTORY = module_text("factory", START["multiprocessing"])
IMPORT_POPEN = module_text("import", START["popen"])
FORWARD_POPEN = module_text("forward", START["popen"])

HELPER = RECORD + '''
import subprocess

HELPER = []

class Model(torch.nn.Linear):
    def forward(self, x):
        if HELPER[0].poll() is not None:
            raise RuntimeError("the helper has gone")
        return super().forward(x)

def factory(micro_batch: int = 2):
    HELPER.append(subprocess.Popen(["sleep", "1000"]))
    record(HELPER[0].pid)
    return Model(8, 8), torch.randn(micro_batch, 8), lambda out: out.sum()
'''

ATEXIT_FAILING = '''import atexit
import os
import sys
from atexit import register

register(lambda: sys.exit(0))

def factory(micro_batch: int = 2):
    atexit.register(lambda: os._exit(0))
    atexit.register(lambda: 1 / 0)
    raise ValueError("no model here")
'''

ATEXIT_JSON = '''import atexit
import os
import torch

def factory(micro_batch: int = 2):
    atexit.register(lambda: (print("not JSON"), os._exit(3)))
    return torch.nn.Linear(8, 8), torch.randn(micro_batch, 8), lambda out: out.sum()
'''

FORK_RETURNS = '''import os
import torch

def factory(micro_batch: int = 2):
    child = os.fork()
    if child:
        os.waitpid(child, 0)
    return torch.nn.Linear(8, 8), torch.randn(micro_batch, 8), lambda out: out.sum()
'''

def _kill_recorded(tmp: Path) -> None:
    for pid, start in recorded(tmp / "f.py"):
        if running(pid, start):
            os.kill(pid, signal.SIGKILL)

def processes_left(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
    """The command, its output to files; then {tmp}/running: the recorded processes still running (then killed)."""
    with open(tmp / "stdout", "w+") as out, open(tmp / "stderr", "w+") as err:
        p = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=err, preexec_fn=preexec,
                             start_new_session=True)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            _kill_recorded(tmp)
            raise
        alive = [str(pid) for pid, start in recorded(tmp / "f.py") if running(pid, start)]
        (tmp / "running").write_text(" ".join(alive))
        _kill_recorded(tmp)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read())

def real_command(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
    """The command as a process of its own (what an atexit handler or a fork does shows in a real process only)."""
    return processes_left(cmd, tmp, timeout, preexec)

def _none_running(out: str, err: str, tmp: Path) -> str | None:
    running = (tmp / "running").read_text().split()
    return f"still running after the command: {', '.join(running)}" if running else None

def _one_json(out: str, err: str, tmp: Path) -> str | None:
    try:
        json.loads(out)
    except ValueError:
        return "stdout is not one JSON object"
    return None

SIM = ("simulate", "--module", "{tmp}/f.py:factory", "--device", "cpu", "--steps", "1")

USER_CODE_CASES = [
    Case("user-popen-outlives", "user code", "a factory's subprocess.Popen(['sleep', '1000']) outlived peakledger",
         SIM, {"f.py": _text(POPEN_FACTORY)}, code=0, check=_none_running, driver=processes_left),
    Case("user-daemon-outlives", "user code", "a factory's double-forked setsid daemon outlived peakledger",
         SIM, {"f.py": _text(DAEMON_FACTORY)}, code=0, check=_none_running, driver=processes_left),
    Case("user-multiprocessing-outlives", "user code", "a factory's multiprocessing.Process outlived peakledger "
         "(and multiprocessing's exit joined it: peakledger never ended)",
         SIM, {"f.py": _text(MP_FACTORY)}, code=0, check=_none_running, driver=processes_left),
    Case("user-import-popen-outlives", "user code", "a process the module's import started outlived peakledger",
         SIM, {"f.py": _text(IMPORT_POPEN)}, code=0, check=_none_running, driver=processes_left),
    Case("user-forward-popen-outlives", "user code", "a process the model's forward started outlived peakledger",
         SIM, {"f.py": _text(FORWARD_POPEN)}, code=0, check=_none_running, driver=processes_left),
    Case("user-helper-serves-forward", "user code", "a helper the factory starts serves the forward (ended with "
         "the command, not before), then ends", SIM, {"f.py": _text(HELPER)}, code=0, check=_none_running,
         driver=processes_left),
    Case("user-atexit-exit-status", "user code", "an atexit handler calling os._exit(0) turned a failed factory's "
         "exit 2 into exit 0", SIM, {"f.py": _text(ATEXIT_FAILING)}, code=2, says=("raised ValueError",),
         driver=real_command),
    Case("user-atexit-json", "user code", "an atexit handler printed into --json and set exit 3",
         (*SIM, "--json"), {"f.py": _text(ATEXIT_JSON)}, code=0, check=_one_json, driver=real_command),
    Case("user-fork-returns", "user code", "a process the factory forked returned from it and ran a second "
         "simulation (a second report on stdout)", (*SIM, "--json"), {"f.py": _text(FORK_RETURNS)}, code=0,
         check=_one_json, driver=real_command),
]

__all__ = ["USER_CODE_CASES", "START", "HELPER", "RECORD", "module_text", "recorded", "running", "processes_left",
           "real_command"]
