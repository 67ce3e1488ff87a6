"""Sweeps under faults (issue 34): a worker killed mid-sweep, a point that kills its worker, a grid too large, a
sweep too long, cluster addresses that are malformed, closed, absent or silent. Each ends with the rows of an
undisturbed sweep or with one line naming the input (ConfigError, the CLI's exit 2), nothing returned, nothing
written, no traceback, no process left behind, and within a bound.

`killed_worker(...)` (bench/hardening_cases_34.py, a driver of the hardening cases) runs a real `peakledger sweep`
command and SIGKILLs one of its worker processes mid-sweep, as the kernel's out-of-memory killer does.
`POISON_RUNNER` is a CLI runner (`python -c POISON_RUNNER argv...`) whose local pool workers SIGKILL
themselves on the point micro_batch=3: a point that kills its worker every time.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hardening_cases_34 import SilentPeer, killed_worker

from peakledger import build_scenario, sweep
from peakledger.cli import main
from peakledger.models.config import ConfigError
from peakledger.sweep import address as address_mod
from peakledger.sweep import engines, pool, run_sweep, to_csv

RUNNER = "import sys; from peakledger.cli import main; sys.exit(main(sys.argv[1:]))"
# the local pool's workers (forks of the command's process) SIGKILL themselves on every point with micro_batch=3
POISON_RUNNER = (
    "import os, signal, sys\n"
    "from peakledger.sweep import pool\n"
    "real = pool.evaluate\n"
    "def evaluate(task):\n"
    "    if task[1].get('micro_batch') == 3:\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return real(task)\n"
    "pool.evaluate = evaluate\n"
    "from peakledger.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")
TINY = ["--preset", "tiny", "--device", "cpu"]
# 600 points of the tiny GPT (2 to 7 ms each): ~1.5 s on 2 workers
GRID = {"micro_batch": list(range(1, 21)), "seq_len": list(range(2, 62, 2))}
GRID_ARGS = ["--grid", "micro_batch=" + ",".join(map(str, GRID["micro_batch"])),
             "--grid", "seq_len=" + ",".join(map(str, GRID["seq_len"]))]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_ray = pytest.mark.skipif(not installed("ray"), reason="pip install ray")
needs_dask = pytest.mark.skipif(not installed("distributed"), reason="pip install dask distributed")


@pytest.fixture(scope="module")
def base():
    return build_scenario({"preset": "tiny"}, {"steps": 1}, {"device": "cpu"})


@pytest.fixture(scope="module")
def undisturbed(base):
    return to_csv(run_sweep(base, GRID, jobs=1, progress=False))


# --- a harness's tools: a command's worker processes, and a driver that kills one -------------------------------

def _one_line_error(code: int, err: str) -> None:
    assert code == 2, err
    assert err.startswith("peakledger: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


# --- (a) a worker lost mid-sweep ------------------------------------------------------------------------------

def test_a_worker_killed_mid_sweep_is_replaced_and_the_rows_are_the_undisturbed_ones(base, undisturbed,
                                                                                    monkeypatch):
    """One pool worker SIGKILLed once 100 points are back: its points go to a fresh worker; same bytes."""
    killed = []

    class KillOnce(sweep._progress):
        done = 0

        def advance(self, n: int = 1) -> None:
            super().advance(n)
            KillOnce.done += n
            if KillOnce.done >= 100 and not killed:
                victim = multiprocessing.active_children()[0]
                os.kill(victim.pid, signal.SIGKILL)
                killed.append(victim.pid)

    monkeypatch.setattr(sweep, "_progress", KillOnce)
    start = time.monotonic()
    result = run_sweep(base, GRID, jobs=2)
    assert killed and time.monotonic() - start < 30
    assert to_csv(result) == undisturbed
    assert multiprocessing.active_children() == []


def test_a_point_that_kills_its_worker_fails_the_sweep_in_one_line(base, monkeypatch):
    real = pool.evaluate
    tried = multiprocessing.get_context("fork").Value("i", 0)

    def evaluate(task):
        if task[1] == {"micro_batch": 3, "seq_len": 16}:
            with tried.get_lock():
                tried.value += 1
            os.kill(os.getpid(), signal.SIGKILL)
        return real(task)

    monkeypatch.setattr(pool, "evaluate", evaluate)
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        run_sweep(base, GRID, jobs=2, progress=False)
    assert time.monotonic() - start < 30
    assert str(e.value) == ("grid: the point micro_batch=3, seq_len=16 killed its worker process twice (SIGKILL: what "
                            "the kernel's out-of-memory killer sends, see `dmesg`); nothing written; leave it out of "
                            "the grid or give the sweep more memory (fewer --jobs)")
    assert tried.value == pool.MAX_ATTEMPTS  # tried again once, not forever
    assert multiprocessing.active_children() == []


def test_a_killed_worker_in_a_real_command(tmp_path):
    """The CLI as a command, one of its workers SIGKILLed mid-sweep (killed_worker): exit 0, the undisturbed CSV."""
    args = ["sweep", *TINY, *GRID_ARGS, "--jobs", "2", "--output"]
    calm = subprocess.run([sys.executable, "-c", RUNNER, *args, "calm.csv"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert calm.returncode == 0, calm.stderr
    start = time.monotonic()
    driver = killed_worker(after_s=0.2)
    done = driver([sys.executable, "-c", RUNNER, *args, "s.csv"], tmp_path, 60)
    assert len(driver.killed) == 1  # mid-sweep
    # nothing on stderr but, on a slow (loaded) machine, the sweep's own estimate of a long wall time
    # (cmd_simulate._say_estimate: "sweep: N points at about ... each on 2 workers: about ...")
    said = [line for line in done.stderr.splitlines() if not re.fullmatch(r"sweep: [\d,]+ points at about .+", line)]
    assert done.returncode == 0 and said == [], done.stderr
    assert time.monotonic() - start < 60
    assert (tmp_path / "s.csv").read_bytes() == (tmp_path / "calm.csv").read_bytes()


def test_a_point_that_kills_its_worker_in_a_real_command(tmp_path):
    p = subprocess.run([sys.executable, "-c", POISON_RUNNER, "sweep", *TINY, "--grid", "micro_batch=1,2,3,4",
                        "--jobs", "2", "--output", "s.csv"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    _one_line_error(p.returncode, p.stderr)
    assert "the point micro_batch=3 killed its worker process twice (SIGKILL" in p.stderr
    assert not (tmp_path / "s.csv").exists()


def _poisoned_chunk(real: Callable) -> Callable:
    """A cluster task that SIGKILLs its worker on micro_batch=3 (cloudpickle sends this closure by value)."""
    def chunk(tasks: list) -> list:
        import os
        import signal
        if any(t[1].get("micro_batch") == 3 for t in tasks):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tasks)
    return chunk


@pytest.mark.parametrize("engine", [pytest.param("dask", marks=needs_dask), pytest.param("ray", marks=needs_ray)])
def test_a_point_that_kills_its_cluster_worker_fails_the_sweep_in_one_line(base, engine, monkeypatch):
    """ray retries the task once (max_retries), dask's local scheduler too (allowed-failures): then one line."""
    monkeypatch.setattr(engines, "evaluate_timed_chunk", _poisoned_chunk(engines.evaluate_timed_chunk))
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        run_sweep(base, {"micro_batch": [1, 2, 3, 4]}, jobs=2, progress=False, engine=engine)
    assert time.monotonic() - start < 60
    # (the first points go 2 to a task, timed for the estimate)
    assert str(e.value).startswith("grid: the points micro_batch=3; micro_batch=4 (one task) lost their worker each "
                                   "time they ran ("), str(e.value)
    assert "nothing written" in str(e.value)


# --- (b) the number of points -----------------------------------------------------------------------------------

def test_a_grid_over_the_point_bound_is_refused_before_any_point(base, monkeypatch):
    def never(task):
        raise AssertionError("a point was simulated")

    monkeypatch.setattr(pool, "evaluate", never)
    monkeypatch.setattr(engines, "evaluate", never)
    huge = {"micro_batch": list(range(1, 101)), "seq_len": list(range(1, 101)), "n_layer": list(range(1, 101)),
            "grad_accum": list(range(1, 101))}
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        run_sweep(base, huge, progress=False)
    assert time.monotonic() - start < 1
    assert str(e.value) == ("grid: 100,000,000 points (100 micro_batch x 100 seq_len x 100 n_layer x 100 grad_accum) "
                            "is over the bound of 10,000 points a sweep may have; make the grid smaller or raise the "
                            "bound with --max-points 100000000 (run_sweep's max_points)")
    with pytest.raises(ConfigError, match="^grid: 4 points .* over the bound of 3 points"):
        run_sweep(base, {"micro_batch": [1, 2, 3, 4]}, progress=False, max_points=3)
    with pytest.raises(ConfigError, match="^max_points: "):
        run_sweep(base, {"micro_batch": [1]}, progress=False, max_points=0)


def test_a_grid_over_the_point_bound_is_one_line_from_the_cli(tmp_path, capsys):
    values = ",".join(map(str, range(1, 101)))
    start = time.monotonic()
    code = main(["sweep", *TINY, "--grid", f"micro_batch={values}", "--grid", f"seq_len={values}",
                 "--grid", f"n_layer={values}", "--grid", f"grad_accum={values}", "--output", str(tmp_path / "s.csv")])
    _one_line_error(code, capsys.readouterr().err)
    assert time.monotonic() - start < 2 and not (tmp_path / "s.csv").exists()


def test_the_bound_is_raised_by_max_points(base):
    result = run_sweep(base, {"micro_batch": [1, 2, 3, 4]}, jobs=1, progress=False, max_points=4)
    assert [p.values["micro_batch"] for p in result] == [1, 2, 3, 4]


# --- (c) the wall time ------------------------------------------------------------------------------------------

def _slow_points(monkeypatch, seconds: Callable[[dict], float]) -> None:
    """Every point takes `seconds(values)` more (the local pool's workers are forks: they have it too)."""
    real = pool.evaluate

    def evaluate(task):
        time.sleep(seconds(task[1]))
        return real(task)

    monkeypatch.setattr(pool, "evaluate", evaluate)
    monkeypatch.setattr(engines, "evaluate", evaluate)


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_estimate_is_reported_and_one_over_the_limit_refuses_the_rest(base, monkeypatch, jobs):
    _slow_points(monkeypatch, lambda values: 0.05)
    grid = {"micro_batch": list(range(1, 201))}  # 200 x 0.05 s: 10 s on one worker, 5 s on two
    estimates = []
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        run_sweep(base, grid, jobs=jobs, progress=False, time_limit_s=2.0, on_estimate=estimates.append)
    assert time.monotonic() - start < 2.0  # refused after the timed points, not at the limit
    (est,) = estimates
    assert (est.points, est.workers, est.timed, est.time_limit_s) == (200, jobs, 2 * jobs, 2.0)
    assert est.per_point_s >= 0.05 and est.total_s >= 200 * 0.05 / jobs and est.over_limit
    assert est.line().startswith("sweep: 200 points at about ") and "(time limit 2.00 s)" in est.line()
    assert str(e.value).startswith("time_limit: the sweep would take about ")
    assert f"over its time limit of 2.00 s; refused after {2 * jobs} points; nothing written; raise the limit with " \
           "--time-limit" in str(e.value)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_time_limit_stops_the_run(base, monkeypatch, jobs):
    """The first points are quick (the estimate is well within the limit), the others slow: stopped at the limit."""
    _slow_points(monkeypatch, lambda values: 0.0 if values["micro_batch"] <= 4 else 0.3)
    grid = {"micro_batch": list(range(1, 31))}  # estimated ~0.3 s, runs ~8 s on one worker: stopped after 1.5 s
    estimates = []
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        run_sweep(base, grid, jobs=jobs, progress=False, time_limit_s=1.5, on_estimate=estimates.append)
    took = time.monotonic() - start
    assert 1.5 <= took < 5
    assert estimates and not estimates[0].over_limit
    message = str(e.value)
    assert message.startswith("time_limit: the sweep ran past its time limit of 1.50 s with ")
    assert message.endswith(" of 30 points done; nothing written; raise the limit with --time-limit (run_sweep's "
                            "time_limit_s) or make the grid smaller")
    done = int(message.split(" with ")[1].split(" of ")[0])
    assert 2 * jobs <= done < 30
    assert multiprocessing.active_children() == []


def test_no_time_limit_and_no_callback_make_no_estimate(base):
    result = run_sweep(base, {"micro_batch": [1, 2, 3]}, jobs=2, progress=False, time_limit_s=None)
    assert len(result) == 3
    with pytest.raises(ConfigError, match="^time_limit: "):
        run_sweep(base, {"micro_batch": [1]}, progress=False, time_limit_s=0)


# --- (d) cluster addresses -------------------------------------------------------------------------------------

def _sweep_on(engine: str, address: str, tmp_path) -> list[str]:
    return ["sweep", *TINY, "--engine", engine, "--address", address, "--grid", "micro_batch=1,2",
            "--output", str(tmp_path / "s.csv")]


@pytest.mark.parametrize("engine, address, why", [
    ("ray", "ray://:x", "no host"),
    ("ray", "ray://", "no port"),
    ("ray", "local", "no port"),
    ("ray", "http://127.0.0.1:6379", "unknown scheme 'http://'"),
    ("ray", "127.0.0.1:0", "the port '0' is not a number from 1 to 65535"),
    ("ray", "127.0.0.1:65536", "the port '65536' is not a number from 1 to 65535"),
    ("ray", "127.0.0.1:6379/x", "a '/'"),
    ("ray", "::1:6379", "an IPv6 host goes in brackets"),
    ("ray", "300.1.1.1:6379", "'300.1.1.1' is not an IPv4 address"),
    ("ray", "host name:6379", "it has spaces"),
    ("dask", "tcp//127.0.0.1:8786", "a '/'"),
    ("dask", "http://127.0.0.1:8786", "unknown scheme 'http://'"),
    ("dask", "tls://127.0.0.1:8786", "unknown scheme 'tls://'"),
    ("dask", "tcp://127.0.0.1", "no port"),
    ("dask", "tcp://127.0.0.1:port", "the port 'port' is not a number"),
    ("dask", "[::1:8786", "an IPv6 host in brackets is followed by :port"),
    ("dask", "auto", "no port"),
])
def test_a_malformed_address_is_refused_at_once(tmp_path, capsys, engine, address, why):
    if not installed("ray" if engine == "ray" else "distributed"):
        pytest.skip(f"the {engine} engine is not installed")
    start = time.monotonic()
    code = main(_sweep_on(engine, address, tmp_path))
    err = capsys.readouterr().err
    _one_line_error(code, err)
    assert time.monotonic() - start < 2
    assert err.startswith(f"peakledger: error: address: cannot read {address!r} as a {engine} address: {why}"), err
    assert "allowed: " in err and ("ray://host:port" if engine == "ray" else "tcp://host:port") in err


@needs_ray
def test_ray_on_a_closed_port_is_refused_within_seconds(tmp_path, capsys):
    start = time.monotonic()
    code = main(_sweep_on("ray", "127.0.0.1:1", tmp_path))
    err = capsys.readouterr().err
    _one_line_error(code, err)
    assert time.monotonic() - start < 5
    assert err == ("peakledger: error: address: no ray cluster at 127.0.0.1:1: nothing listens there (connection "
                   "refused); give a running cluster's host:port (`ray status` on its head node shows it), or leave "
                   "--address out for a local cluster\n")


@needs_ray
def test_ray_auto_without_a_cluster_is_refused_within_seconds(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where `ray start` would have written its address
    start = time.monotonic()
    code = main(_sweep_on("ray", "auto", tmp_path))
    err = capsys.readouterr().err
    _one_line_error(code, err)
    assert time.monotonic() - start < 5
    assert err.startswith("peakledger: error: address: --address auto: no ray cluster is running here (RAY_ADDRESS "
                          f"is not set and there is no {tmp_path}/ray/ray_current_cluster")


def test_ray_auto_is_resolved_as_ray_resolves_it(tmp_path):
    env = {"RAY_TMPDIR": str(tmp_path)}
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.5:6379\n")
    read = address_mod._read_small
    assert address_mod.resolve_ray_auto(env, read) == (address_mod.Address("ray", "", "10.0.0.5", 6379),
                                                        str(tmp_path / "ray" / "ray_current_cluster"))
    assert address_mod.resolve_ray_auto({**env, "RAY_ADDRESS": "ray://h:10001"}, read) == (
        address_mod.Address("ray", "ray", "h", 10001), "RAY_ADDRESS")
    with pytest.raises(ConfigError, match=r"^address: cannot read 'h:x' \(from RAY_ADDRESS\) as a ray address"):
        address_mod.resolve_ray_auto({"RAY_ADDRESS": "h:x"}, read)


@pytest.mark.parametrize("engine, says", [
    pytest.param("dask", "no dask scheduler at tcp://127.0.0.1:{port}: it accepted the connection but sent nothing "
                 "within 0.5 s, and a dask scheduler sends its handshake at once", marks=needs_dask),
    pytest.param("ray", "no ray cluster at 127.0.0.1:{port}: it accepted the connection but did not answer an HTTP/2 "
                 "greeting within 0.5 s", marks=needs_ray),
])
def test_a_peer_that_accepts_but_never_answers_is_refused_within_the_timeout(tmp_path, capsys, monkeypatch,
                                                                            engine, says):
    monkeypatch.setattr(address_mod, "PROBE_TIMEOUT_S", 0.5)
    with SilentPeer() as port:
        start = time.monotonic()
        code = main(_sweep_on(engine, f"tcp://127.0.0.1:{port}" if engine == "dask" else f"127.0.0.1:{port}",
                              tmp_path))
        took = time.monotonic() - start
    err = capsys.readouterr().err
    _one_line_error(code, err)
    assert 0.5 <= took < 3
    assert err.startswith("peakledger: error: address: " + says.format(port=port)), err
    assert not (tmp_path / "s.csv").exists()


@needs_dask
def test_an_http_server_is_no_dask_scheduler_nor_a_ray_cluster(monkeypatch):
    """An HTTP server answers an HTTP/2 greeting with its own 400 (not a SETTINGS frame), and sends nothing first."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert address_mod.probe(address_mod.parse_address("ray", f"127.0.0.1:{port}"), 2.0) == (
            "it answered, but not as a ray cluster's GCS (a gRPC server) does (another kind of server?)")
        assert "sent nothing within 0.3 s" in address_mod.probe(address_mod.parse_address("dask", f"127.0.0.1:{port}"),
                                                                0.3)
    finally:
        server.shutdown()
        server.server_close()


@needs_dask
def test_sigterm_while_an_address_is_probed_exits_143_at_once(tmp_path):
    with SilentPeer() as port:
        p = subprocess.Popen([sys.executable, "-c", RUNNER, *_sweep_on("dask", f"127.0.0.1:{port}", tmp_path)],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            end = time.monotonic() + 20
            while not _connected_to(port) and time.monotonic() < end:  # the probe is waiting for an answer
                time.sleep(0.05)
            start = time.monotonic()
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=10)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert time.monotonic() - start < 2
    assert (p.returncode, err) == (143, "peakledger: terminated: nothing written\n")


def _connected_to(port: int) -> bool:
    """Whether a TCP connection to 127.0.0.1:`port` is established (/proc/net/tcp: local port in hex, state 01)."""
    text = Path("/proc/net/tcp").read_text()
    return any(line.split()[2].endswith(f":{port:04X}") and line.split()[3] == "01" for line in text.splitlines()[1:])
