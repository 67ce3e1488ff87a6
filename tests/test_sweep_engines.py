"""Sweep engines: local pool, ray and dask give the same rows and the same CSV / JSON bytes; bad engine,
address and jobs are refused; Ctrl-C or SIGTERM stops the workers, writes nothing and leaves no process.

The ray and dask tests start a 2-worker local cluster on 127.0.0.1 (ray: ~10 s to start on 2 cores,
dask: ~3 s). They are skipped where the extras are not installed; `pip install -e '.[dev]'` has them.
Availability is checked with find_spec, never by importing ray: peakledger.sweep sets the environment
that keeps a local ray cluster on the loopback interface, and ray reads it when it is first imported.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from peakledger import build_scenario, sweep
from peakledger.models.config import ConfigError
from peakledger.sweep import run_sweep, to_csv, to_json

# 200 points of the tiny GPT: 10 micro-batches x 5 sequence lengths (128 > the model's 64: error rows) x 4 stages
GRID_200 = {"micro_batch": list(range(1, 11)), "seq_len": [8, 16, 32, 64, 128], "zero_stage": [0, 1, 2, 3]}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


CLUSTER_ENGINES = [pytest.param("ray", marks=pytest.mark.skipif(not installed("ray"), reason="pip install ray")),
                   pytest.param("dask", marks=pytest.mark.skipif(not installed("distributed"),
                                                                 reason="pip install dask distributed"))]


@pytest.fixture(scope="module")
def base():
    return build_scenario({"preset": "tiny"}, {"steps": 1})


@pytest.fixture(scope="module")
def local_bytes(base):
    result = run_sweep(base, GRID_200, jobs=1, progress=False)
    return to_csv(result), to_json(result, base, GRID_200)


class CountingBar(sweep._progress):
    """The real bar, made to count what it is advanced by (the bar itself only draws on a terminal), and
    to note the address of a ray node running meanwhile."""
    advanced: list = []
    ray_nodes: set = set()

    def advance(self, n: int = 1) -> None:
        CountingBar.advanced.append(n)
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            CountingBar.ray_nodes.add(sys.modules["ray"].util.get_node_ip_address())
        super().advance(n)


def test_local_pool_gives_the_inline_bytes(base, local_bytes):
    result = run_sweep(base, GRID_200, jobs=2, progress=False)
    assert (to_csv(result), to_json(result, base, GRID_200)) == local_bytes
    assert len(result) == 200 and sum(1 for p in result if p.result["error"]) == 40


@pytest.mark.parametrize("engine", CLUSTER_ENGINES)
def test_cluster_engine_gives_the_local_bytes_and_advances_the_bar(engine, base, local_bytes, monkeypatch):
    monkeypatch.setattr(sweep, "_progress", CountingBar)
    CountingBar.advanced, CountingBar.ray_nodes = [], set()
    sigterm_before = signal.getsignal(signal.SIGTERM)
    result = run_sweep(base, GRID_200, jobs=2, engine=engine)
    assert (to_csv(result), to_json(result, base, GRID_200)) == local_bytes
    assert sum(CountingBar.advanced) == 200 and len(CountingBar.advanced) > 1  # chunk by chunk
    assert signal.getsignal(signal.SIGTERM) == sigterm_before  # ray.init's own SIGTERM handler is not left behind
    if engine == "ray":
        import ray
        assert CountingBar.ray_nodes == {"127.0.0.1"}  # the local cluster listens on the loopback interface
        assert not ray.is_initialized()  # and is shut down


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(engine="spark"), "engine", ["'spark'", "local, ray, dask"]),
    (dict(engine="local", address="127.0.0.1:6379"), "address", ["ray or dask"]),
    (dict(jobs=0), "jobs", ["positive integer", "0"]),
    (dict(jobs=-3), "jobs", ["positive integer", "-3"]),
    (dict(jobs=1.5), "jobs", ["positive integer"]),
    (dict(jobs=True), "jobs", ["positive integer"]),
    (dict(engine="ray", address=""), "address", ["ray: host:port"]),
    (dict(engine="dask", address="tcp://127.0.0.1:8786", jobs=2), "jobs", ["drop jobs"]),
])
def test_bad_engine_address_or_jobs_is_a_config_error(base, kwargs, field, words):
    with pytest.raises(ConfigError) as e:
        run_sweep(base, {"micro_batch": [1]}, progress=False, **kwargs)
    assert str(e.value).startswith(f"{field}: ")
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("engine, module, extra", [("ray", "ray", "peakledger[ray]"),
                                                   ("dask", "distributed", "peakledger[dask]")])
def test_a_missing_engine_package_names_the_extra(base, monkeypatch, engine, module, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(ConfigError) as e:
        run_sweep(base, {"micro_batch": [1]}, engine=engine, progress=False)
    assert str(e.value).startswith("engine: ") and f"pip install '{extra}'" in str(e.value)


# A sweep in a child process of its own session (as a terminal runs a command), with a SIGTERM handler like
# the CLI's: the harness waits for the first finished task, then sends Ctrl-C to the whole process group
# (what a terminal does) or SIGTERM to the parent alone (what `kill` does). The 1000-point gpt2 grid takes
# far longer than that.
CHILD = textwrap.dedent("""
    import signal, sys
    from peakledger import build_scenario, sweep

    class Terminated(KeyboardInterrupt):
        pass

    def on_sigterm(signum, frame):
        raise Terminated()

    def main():
        engine, out = sys.argv[1], sys.argv[2]
        signal.signal(signal.SIGTERM, on_sigterm)
        # a terminal's command gets Ctrl-C; a test run started in the background inherits SIGINT ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        advance = sweep._progress.advance
        def first_advance(self, n=1):
            if not getattr(sweep, "_said", False):
                sweep._said = True
                print("running", flush=True)
            advance(self, n)
        sweep._progress.advance = first_advance
        base = build_scenario({"preset": "gpt2"}, {"steps": 1, "world_size": 8})
        grid = {"micro_batch": list(range(1, 11)), "seq_len": [128, 256, 512, 768, 1024],
                "zero_stage": [0, 1, 2, 3], "precision": ["fp32", "bf16-mixed", "bf16-autocast", "bf16", "fp16-mixed"]}
        try:
            result = sweep.run_sweep(base, grid, jobs=2, engine=engine)
        except KeyboardInterrupt as e:
            print("terminated" if isinstance(e, Terminated) else "interrupted", flush=True)
            sys.exit(143 if isinstance(e, Terminated) else 130)
        sweep.write(result, base, grid, out, None)
        print("finished", flush=True)

    if __name__ == "__main__":
        main()
""")
EXPECTED = {"ctrl-c": (130, "interrupted\n", ""), "sigterm": (143, "terminated\n", "")}  # no traceback, no noise


def _group(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if name.isdigit() and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(name))
    return pids


def _interrupt_a_sweep(tmp_path, engine: str, how: str):
    script, out = tmp_path / "child.py", tmp_path / "s.csv"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), engine, str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline() == "running\n"
        if how == "ctrl-c":
            os.killpg(child.pid, signal.SIGINT)
        else:
            os.kill(child.pid, signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _group(child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return child.returncode, stdout, stderr, out.exists(), _group(child.pid)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupting_a_local_sweep_stops_the_workers_and_writes_nothing(tmp_path, how):
    rc, stdout, stderr, written, left = _interrupt_a_sweep(tmp_path, "local", how)
    assert (rc, stdout, stderr) == EXPECTED[how]  # no worker traceback, no BrokenPipe
    assert not written and left == []


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
@pytest.mark.parametrize("engine", CLUSTER_ENGINES)
def test_interrupting_a_cluster_sweep_shuts_the_cluster_down_and_writes_nothing(tmp_path, engine, how):
    rc, stdout, stderr, written, left = _interrupt_a_sweep(tmp_path, engine, how)
    assert (rc, stdout, stderr) == EXPECTED[how]
    assert not written and left == []


def test_a_callers_sigterm_handler_is_kept_and_the_pool_still_stops(base):
    """The CLI installs its own SIGTERM handler (raising its KeyboardInterrupt subclass, exit 143): run_sweep
    keeps it, and its exception still stops the pool."""
    import multiprocessing
    import threading

    class Terminated(KeyboardInterrupt):
        pass

    def on_sigterm(signum, frame):
        raise Terminated()

    grid = {"micro_batch": list(range(1, 11)), "seq_len": [16, 32, 64], "zero_stage": [0, 1, 2, 3],
            "n_layer": list(range(1, 41))}  # 4800 points of the tiny GPT: far longer than the 1 s wait
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(Terminated):
            run_sweep(base, grid, jobs=2, progress=False)
        assert signal.getsignal(signal.SIGTERM) is on_sigterm
        assert multiprocessing.active_children() == []
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
