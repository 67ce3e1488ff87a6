"""Issue 34, "User code": what a `--module` file's code leaves behind once peakledger is done with it.

1. The processes it starts (from the module's import, the factory, the model's forward; a Popen, a daemon forked
   twice, a multiprocessing.Process) end with the command, and not before (a helper the factory starts still serves
   the forward); peakledger's own processes are left alone (models/traced/processes.py).
2. Its atexit handlers cannot change peakledger's exit status, nor write to stdout (models/traced/boundary.py).
Each command runs as a real process, as the console script runs it (`sys.exit(main())`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hardening_user_code import HELPER, START, module_text, recorded, running

from peakledger.models.traced import processes
from peakledger.models.traced.boundary import own_processes, user_code

RUNNER = "import sys; from peakledger.cli import main; sys.exit(main(sys.argv[1:]))"

# the module texts are the hardening cases' (bench/hardening_user_code.py): RECORD's record(pid) notes a process



@pytest.fixture
def module(tmp_path):
    """The module file's path; whatever it recorded and still runs after the test is killed."""
    path = tmp_path / "f.py"
    yield path
    for pid, start in recorded(path):
        if running(pid, start):
            os.kill(pid, signal.SIGKILL)


def _simulate(path, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", RUNNER, "simulate", "--module", f"{path}:factory", "--device", "cpu", "--steps", "1",
            *extra]
    # its output to files, not pipes: a process left running would hold a pipe open, and the run wait for it
    with open(path.parent / "stdout", "w+") as out, open(path.parent / "stderr", "w+") as err:
        code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, timeout=timeout,
                              cwd=path.parent).returncode
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are followed on Linux (/proc)")
@pytest.mark.parametrize("where, kind", [("factory", "popen"), ("factory", "daemon"), ("factory", "multiprocessing"),
                                         ("import", "popen"), ("forward", "popen")])
def test_processes_the_users_code_starts_end_with_the_command(module, where, kind):
    module.write_text(module_text(where, START[kind]))
    run = _simulate(module)
    assert run.returncode == 0, run.stderr
    started = recorded(module)
    assert len(started) == 1
    assert not [p for p in started if running(*p)], f"still running after the command: {started}"
    assert "Traceback" not in run.stderr  # ended quietly (no peakledger handler raising in a fork)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are followed on Linux (/proc)")
def test_a_helper_the_factory_starts_still_serves_the_forward(module):
    # ended with the command, not with the block that started it
    module.write_text(HELPER)
    run = _simulate(module)
    assert run.returncode == 0, run.stderr
    assert not [p for p in recorded(module) if running(*p)]


def test_atexit_handlers_cannot_change_the_exit_status(module):
    # a factory that fails (exit 2) registers handlers that would end the process 0, or print, or raise
    module.write_text('''
import atexit
import os
import sys
from atexit import register  # the name taken at import: the guarding one

register(lambda: sys.exit(0))


def factory(micro_batch: int = 2):
    atexit.register(lambda: os._exit(0))
    atexit.register(lambda: print("printed at exit"))
    atexit.register(lambda: 1 / 0)
    atexit.register(os._exit, 0)
    raise ValueError("no model here")
''')
    run = _simulate(module)
    assert run.returncode == 2, run.stderr
    assert "peakledger: error: module: factory(micro_batch=2) raised ValueError: no model here" in run.stderr
    assert "printed at exit" in run.stderr and "printed at exit" not in run.stdout
    lines = [line for line in run.stderr.splitlines() if "atexit handler" in line]
    assert lines == ["peakledger: warning: module: an atexit handler of factory(micro_batch=2) raised "
                     "ZeroDivisionError: division by zero"]
    assert "Traceback" not in run.stderr


def test_an_atexit_handler_keeps_a_json_output_and_a_success(module):
    module.write_text('''
import atexit
import os
import torch


def factory(micro_batch: int = 2):
    atexit.register(lambda: (print("not JSON"), os._exit(3)))
    return torch.nn.Linear(8, 8), torch.randn(micro_batch, 8), lambda out: out.sum()
''')
    run = _simulate(module, "--json")
    assert run.returncode == 0, run.stderr
    assert isinstance(json.loads(run.stdout), dict)


def test_a_process_the_factory_forks_never_runs_peakledger(module):
    # the fork returns from the factory too: it ends there, and never simulates (a second report on stdout)
    module.write_text('''
import os
import torch


def factory(micro_batch: int = 2):
    child = os.fork()
    if child:
        os.waitpid(child, 0)
    return torch.nn.Linear(8, 8), torch.randn(micro_batch, 8), lambda out: out.sum()
''')
    run = _simulate(module, "--json")
    assert run.returncode == 0, run.stderr
    assert isinstance(json.loads(run.stdout), dict)  # one report


# -- in this process ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(processes._TAGGER is None, reason="processes are followed on Linux (/proc)")
def test_only_the_users_processes_are_ended():
    started = [subprocess.Popen(["sleep", "1000"])]  # peakledger's: started outside a block
    try:
        with user_code("factory()"):
            started.append(subprocess.Popen(["sleep", "1000"]))  # the user's
            with own_processes():  # peakledger's code run inside a block (a hook the user's code calls back)
                started.append(subprocess.Popen(["sleep", "1000"]))
        before, users, own = started
        assert processes.end_user_processes() == 1
        assert users.wait(timeout=5) == -signal.SIGTERM
        assert before.poll() is None and own.poll() is None
        assert processes.end_user_processes() == 0  # none left
    finally:
        for p in started:
            p.kill()
            p.wait()


@pytest.mark.skipif(processes._TAGGER is None, reason="processes are followed on Linux (/proc)")
def test_a_pid_another_process_took_is_never_signalled():
    p = subprocess.Popen(["sleep", "1000"])
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
        assert not processes._send((p.pid, start + 1), signal.SIGKILL)  # not the process found at that pid
        time.sleep(0.1)
        assert p.poll() is None
        assert processes._send((p.pid, start), signal.SIGKILL)
        assert p.wait(timeout=5) == -signal.SIGKILL
    finally:
        p.kill()
        p.wait()


def test_atexit_unregister_finds_a_guarded_handler():
    code = textwrap.dedent('''
        import atexit
        from peakledger.models.traced.boundary import user_code

        def dropped():
            print("dropped")

        with user_code("factory()"):
            assert atexit.register(print, "kept") is print
            assert atexit.register(dropped) is dropped
        atexit.unregister(dropped)  # atexit's own, after the block
    ''')
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "kept" in run.stderr and "dropped" not in run.stderr + run.stdout
