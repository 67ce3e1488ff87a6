"""`peakledger serve` (peakledger/serve): a command run on the server is the command run in its own process: the
same stdout, stderr and exit status, byte for byte, its working folder, environment and signals the client's; a
request the server must not run (another environment at import, a stale server) runs in the client; the server's
life (one per installation, --status, --stop, --idle). Each command is a real `peakledger` console script, as a
user runs it; the servers import peakledger alone (`--preload none`) so each starts in a second."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hardening_user_code import START, module_text, recorded, running

from peakledger.serve.protocol import installation
from peakledger.serve.server import Snapshot

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server forks (Linux)")
PEAKLEDGER = os.path.join(os.path.dirname(sys.executable), "peakledger")


def _env(folder, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEAKLEDGER_SERVER")}
    return {**env, "PEAKLEDGER_SERVER_DIR": str(folder), **extra}


def _run(args: list[str], env: dict[str, str], cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PEAKLEDGER, *args], env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def _socket(folder) -> str:
    return os.path.join(str(folder), installation() + ".sock")


def _up(folder, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(_socket(folder))
            return True
        except OSError:
            time.sleep(0.05)
        finally:
            probe.close()
    return False


@pytest.fixture
def sockets():
    """A folder for a server's socket, its path short (a socket's path is at most 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="pls-")
    yield Path(folder) / "s"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def shared():
    """A lock every test with a server holds shared: the stale test takes it alone while a peakledger source's
    modification time is changed (every server up would be stale meanwhile)."""
    fd = os.open(os.path.join(tempfile.gettempdir(), "peakledger-test-serve.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    yield fd
    os.close(fd)


@pytest.fixture
def server(tmp_path, sockets, shared):
    """A server in the foreground (its log in `log`), and the folder of its socket."""
    folder = sockets
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([PEAKLEDGER, "serve", "--preload", "none", "--idle", "300"], env=_env(folder),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        assert _up(folder), (tmp_path / "server.log").read_text()
        yield folder
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_a_command_on_the_server_is_the_command_in_its_own_process(server, tmp_path):
    out = tmp_path / "work"
    out.mkdir()
    for args in (["simulate"], ["simulate", "--preset", "gpt2", "--micro-batch", "2", "--json"],
                 ["simulate", "--micro-batch", "0"],  # bad input: exit 2, one line naming it
                 ["simulate", "--preset", "gtp2"],  # a name misspelt: the closest one offered
                 ["simulate", "--plot", "timeline.png"]):  # a relative output: the client's working folder
        served = _run(args, _env(server, PEAKLEDGER_SERVER="require"), cwd=out)
        if args[-1] == "timeline.png":
            assert (out / "timeline.png").is_file()
            (out / "timeline.png").unlink()
        alone = _run(args, _env(server, PEAKLEDGER_SERVER="off"), cwd=out)
        assert (served.returncode, served.stdout, served.stderr) == (alone.returncode, alone.stdout, alone.stderr)
    assert served.returncode == 0


def test_the_environment_is_the_clients(server, tmp_path):
    # the trace cache's folder is read from the environment when a command runs: the client's, not the server's
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                  "vocab_size": 256, "max_position_embeddings": 128}))
    env = _env(server, PEAKLEDGER_SERVER="require", PEAKLEDGER_CACHE_DIR=str(tmp_path / "cache"))
    run = _run(["simulate", "--hf-config", str(config), "--micro-batch", "1", "--seq-len", "64", "--device", "cpu"],
               env)
    assert run.returncode == 0, run.stderr
    assert any(name.endswith(".json.z") for name in os.listdir(tmp_path / "cache"))


def test_what_the_server_must_not_run_runs_in_the_client(server):
    # an environment torch reads at import that differs from the server's: refused (require: exit 2 naming it;
    # auto: the client runs it, the same output)
    other = _env(server, TORCH_SHOW_CPP_STACKTRACES="1")
    refused = _run(["simulate"], {**other, "PEAKLEDGER_SERVER": "require"})
    assert refused.returncode == 2
    assert "TORCH_SHOW_CPP_STACKTRACES" in refused.stderr and refused.stdout == ""
    assert _run(["simulate"], other).stdout == _run(["simulate"], {**other, "PEAKLEDGER_SERVER": "off"}).stdout


def test_no_server_and_bad_settings(tmp_path, sockets):
    folder = sockets
    alone = _run(["simulate"], _env(folder, PEAKLEDGER_SERVER="off"))
    assert _run(["simulate"], _env(folder)).stdout == alone.stdout  # auto, and none up: run here
    required = _run(["simulate"], _env(folder, PEAKLEDGER_SERVER="require"))
    assert required.returncode == 2 and required.stderr.count("\n") == 1 and "no server" in required.stderr
    assert _run(["serve", "--status"], _env(folder)).returncode == 1 and not folder.exists()  # (nor made)
    bad = _run(["simulate"], _env(folder, PEAKLEDGER_SERVER="yes"))
    assert bad.returncode == 2 and "'yes' is not one of auto, off, require" in bad.stderr
    for flags, says in ((["--idle", "0"], "--idle: 0 is not a positive number"),
                        (["--idle", "x"], "invalid float value"),
                        (["--preload", "llama,notatype"], "transformers has no model type 'notatype'")):
        refused = _run(["serve", *flags], _env(folder))
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
    shared = sockets.parent / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)  # not this user's alone: never used
    refused = _run(["serve"], _env(shared))
    assert refused.returncode == 2 and "mode 700" in refused.stderr
    assert _run(["simulate"], _env(shared)).stdout == alone.stdout


def test_life_one_per_installation_status_stop(server):
    env = _env(server)
    status = _run(["serve", "--status"], env)
    assert status.returncode == 0 and "a server is up" in status.stdout
    second = _run(["serve", "--preload", "none"], env)
    assert second.returncode == 2 and "already up" in second.stderr
    stopped = _run(["serve", "--stop"], env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not os.path.exists(_socket(server))
    assert _run(["serve", "--status"], env).returncode == 1


def test_idle_and_background(sockets):
    env = _env(sockets)
    started = _run(["serve", "--background", "--preload", "none", "--idle", "1"], env)
    assert started.returncode == 0, started.stderr
    assert _run(["serve", "--status"], env).returncode == 0
    deadline = time.monotonic() + 30
    while _run(["serve", "--status"], env).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _run(["serve", "--status"], env).returncode == 1  # ended by itself after a second with no command
    assert "idle for 1 s" in open(_socket(sockets).removesuffix(".sock") + ".log").read()


def test_signals_reach_the_command(server, tmp_path):
    # Ctrl-C at the client: the command is interrupted as in its own process (130, nothing written)
    module = tmp_path / "f.py"
    module.write_text(module_text("factory", "import time\ntime.sleep(120)\n"))
    proc = subprocess.Popen([PEAKLEDGER, "simulate", "--module", f"{module}:factory", "--device", "cpu"],
                            env=_env(server, PEAKLEDGER_SERVER="require"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err


def test_the_users_processes_end_with_a_served_command(server, tmp_path):
    # the fork tags its user code's processes itself (models/traced/processes.py `adopt`), as its own process would
    module = tmp_path / "f.py"
    module.write_text(module_text("factory", START["popen"]))
    try:
        run = _run(["simulate", "--module", f"{module}:factory", "--device", "cpu", "--steps", "1"],
                   _env(server, PEAKLEDGER_SERVER="require"), cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        started = recorded(module)
        assert len(started) == 1 and not [p for p in started if running(*p)]
    finally:
        for pid, start in recorded(module):
            if running(pid, start):
                os.kill(pid, signal.SIGKILL)


def test_a_stale_server_starts_again_on_what_is_installed(server, shared):
    # a source file the server imported changes (its modification time here; put back after): the request is
    # refused and runs in the client, the server starts again (exec: the same pid) and takes the next one
    import peakledger.serve

    source = peakledger.serve.__file__
    st = os.stat(source)
    env = _env(server)
    pid = _run(["serve", "--status"], env).stdout
    fcntl.flock(shared, fcntl.LOCK_EX)  # (the other tests' servers are not up meanwhile)
    try:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        refused = _run(["simulate"], {**env, "PEAKLEDGER_SERVER": "require"})
        assert refused.returncode == 2 and "stale" in refused.stderr and source in refused.stderr
        assert _up(server, timeout=120)
        assert _run(["serve", "--status"], env).stdout == pid
        assert _run(["simulate"], {**env, "PEAKLEDGER_SERVER": "require"}).returncode == 0
    finally:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_stale_server_says_what_changed(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("x = 1\n")
    st = source.stat()
    snapshot = Snapshot(((str(source), st.st_mtime_ns, st.st_size),), (("torch", "0.0"),))
    assert snapshot.changed().startswith("torch 0.0 is now ")
    fresh = Snapshot.take()
    assert fresh.changed() is None
    assert any(path.endswith(os.path.join("serve", "server.py")) for path, _, _ in fresh.files)
    source.write_text("x = 22\n")
    assert Snapshot(((str(source), st.st_mtime_ns, st.st_size),), ()).changed() == f"{source} changed"
