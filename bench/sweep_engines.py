"""Sweep engines side by side: the 1000-point sweep of bench/run.py on the local pool, on ray and on dask,
each with 2 workers, and the files they write compared byte for byte (also on a 200-point grid). Writes
its section of bench/RESULTS.md.

    python bench/sweep_engines.py            # needs the extras: pip install -e '.[ray,dask]'

Each engine is timed twice: as `peakledger sweep --engine E --jobs 2` runs it (a local cluster started
and shut down inside run_sweep, so start-up is included), and on a cluster that is already running (ray:
a session this script opened; dask: a LocalCluster's scheduler address given as `address`), which is
the cost of the sweep itself. Wall-clock, one run each; the machine's load average is printed with them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import tempfile
import time

from sections import replace_section  # bench/sections.py, beside this script

from peakledger import build_scenario
from peakledger.sweep import run_sweep, write

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
HEADING = "## Sweep engines: local pool, ray, dask (2 workers each)"
JOBS = 2

from run import SWEEP_BASE as BASE  # noqa: E402 - bench/run.py's 1000-point sweep
from run import SWEEP_GRID as GRID_1000  # noqa: E402

# 200 points: the same grid at one precision (bf16-mixed, the base's)
GRID_200 = {k: v for k, v in GRID_1000.items() if k != "precision"}


def files_of(result, base, grid, folder: str, name: str) -> bytes:
    """Write the CSV and JSON as the CLI does; their bytes, concatenated, to compare."""
    csv_path, json_path = os.path.join(folder, f"{name}.csv"), os.path.join(folder, f"{name}.json")
    write(result, base, grid, csv_path, json_path)
    with open(csv_path, "rb") as c, open(json_path, "rb") as j:
        return c.read() + b"\0" + j.read()


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def on_running_ray(base, grid) -> tuple[float, list]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only, as run_sweep's own cluster
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    ray.init(num_cpus=JOBS, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        return timed(lambda: run_sweep(base, grid, engine="ray", progress=False))
    finally:
        ray.shutdown()


def on_running_dask(base, grid) -> tuple[float, list]:
    from distributed import LocalCluster
    with LocalCluster(n_workers=JOBS, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster:
        return timed(lambda: run_sweep(base, grid, engine="dask", address=cluster.scheduler_address,
                                       progress=False))


def main() -> None:
    base = build_scenario(*BASE)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        # 200 points: every engine's files, byte for byte
        small = {}
        for name, kwargs in [("local x1", dict(jobs=1)), ("local", dict(jobs=JOBS)),
                             ("ray", dict(engine="ray", jobs=JOBS)), ("dask", dict(engine="dask", jobs=JOBS))]:
            result = run_sweep(base, GRID_200, progress=False, **kwargs)
            small[name] = files_of(result, base, GRID_200, folder, f"small-{name}")
            print(f"200 points, {name}: {hashlib.sha256(small[name]).hexdigest()[:16]}", file=sys.stderr)
        same_200 = len(set(small.values())) == 1
        # 1000 points: timed
        runs = [("local", "fork pool", lambda: run_sweep(base, GRID_1000, jobs=JOBS, progress=False)),
                ("ray", "local cluster started by run_sweep",
                 lambda: run_sweep(base, GRID_1000, jobs=JOBS, engine="ray", progress=False)),
                ("ray", "session already running", lambda: on_running_ray(base, GRID_1000)),
                ("dask", "local cluster started by run_sweep",
                 lambda: run_sweep(base, GRID_1000, jobs=JOBS, engine="dask", progress=False)),
                ("dask", "existing cluster (address)", lambda: on_running_dask(base, GRID_1000))]
        for engine, how, fn in runs:
            load = os.getloadavg()[0]
            t, result = timed(fn)
            if isinstance(result, tuple):  # on a running cluster: the sweep's own time
                t, result = result
            data = files_of(result, base, GRID_1000, folder, f"{engine}-{len(rows)}")
            rows.append((engine, how, t, load, len(result), len(data), hashlib.sha256(data).hexdigest()))
            print(f"1000 points, {engine} ({how}): {t:.1f} s", file=sys.stderr)
    same_1000 = len({row[-1] for row in rows}) == 1
    local_t = rows[0][2]
    lines = [HEADING, "",
             f"`python bench/sweep_engines.py`: the 1000-point gpt2 sweep above (1 step, 8 ranks) with "
             f"`run_sweep(..., engine=E, jobs={JOBS})`, i.e. `peakledger sweep --engine E --jobs {JOBS}`. "
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
             "Wall-clock, one run each; with a cluster started by run_sweep the time includes its start and "
             "shutdown. The load average (1 min) before each run is shown: on a shared machine the times move "
             "with it.", "",
             "| engine | cluster | seconds | vs local | load before | points | CSV + JSON bytes | sha256 |",
             "|---|---|---|---|---|---|---|---|"]
    for engine, how, t, load, n, size, digest in rows:
        lines.append(f"| {engine} | {how} | {t:.1f} | {t / local_t:.2f}x | {load:.1f} | {n} | {size:,} | "
                     f"{digest[:16]} |")
    lines += ["", f"Files byte-identical across every engine and cluster: 1000 points "
                  f"{'yes' if same_1000 else 'NO'}; 200 points (micro_batch x seq_len x ZeRO stage, written by "
                  f"the local pool with 1 and {JOBS} jobs, ray and dask) {'yes' if same_200 else 'NO'}.", ""]
    section = "\n".join(lines) + "\n"
    replace_section(HEADING, section, RESULTS)
    sys.stdout.write(section)
    if not (same_1000 and same_200):
        sys.exit(1)


if __name__ == "__main__":
    main()
