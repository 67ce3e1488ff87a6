"""Sweeps: one scenario simulated over a grid of any inputs, on every core or a cluster, into CSV and JSON.

A grid is `{field: [values]}` over any TrainingSetup, model or run field (`micro_batch`, `seq_len`,
`zero_stage`, `checkpointing`, `n_layer`, `device`, ...); the points are the Cartesian product in the
order the fields were given. Each point is described and simulated independently, optionally with the
largest micro-batch that fits a budget. A point whose values are invalid together (a stage with the
wrong engine, a sequence longer than the model's) is a row with its error, not a crash of the sweep.
Output files are written atomically; same grid, same bytes.

The CSV describes itself: the grid's fields, then the model, precision, device and world size of the points (those
the grid does not vary), then the results, each with its unit in its name (`peak_bytes`, `step_time_s`,
`budget_bytes`: what `fits` was checked against). With a deadline (`deadline=DeadlineBudget(...)`, the CLI's
`--target-tokens` / `--target-steps`, `--deadline`, `--step-time`) each point also gets the deadline columns of
peakledger/deadline.py (tokens per step, steps needed, wall-clock, GPU-hours, verdict, `deadline_rank`): the
columns are computed where the point runs, the ranking once all have come back, so every engine gives the same
bytes. Without `budget`, a deadline sweep checks each point against its device profile's capacity.

Engines (where the points run; the rows, their order and the output bytes are the same on every one):

- `local`: a fork pool of `jobs` processes on this machine (default every core; `jobs=1` runs inline).
- `ray` / `dask` (optional extras `peakledger[ray]`, `peakledger[dask]`): the points go in chunks to an
  existing cluster at `address`, or to a local cluster of `jobs` single-threaded workers started for
  the run and shut down afterwards on every exit path. A local cluster listens on 127.0.0.1 only (ray:
  when ray is first imported by the sweep, as it reads that setting then) and ray's usage statistics are
  off, unless the environment says otherwise. Dask starts its workers with multiprocessing's spawn, which
  re-imports the calling script: guard it with `if __name__ == "__main__"`. On an existing cluster the
  workers need peakledger installed.

Results come back out of order on a cluster and are put back by chunk index. A progress bar goes to
stderr when it is a terminal, on every engine.

Ctrl-C (SIGINT) or SIGTERM during a sweep: the workers stop (the local pool's workers ignore SIGINT, so
only the parent reacts, and it terminates them; cluster futures are cancelled and a local cluster is
shut down), nothing is returned, so nothing is written, and KeyboardInterrupt leaves `run_sweep` for
the caller (the CLI prints one line, exit 130; a SIGTERM handler the caller installed is kept and its
exception leaves instead). Worker processes are started with SIGINT blocked, so a terminal's Ctrl-C,
which reaches the whole process group, gives no worker tracebacks; an interrupt while a cluster is
starting takes effect once it has started (a second one stops waiting for it).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import itertools
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker

from . import api
from . import deadline as dl
from .models.config import ConfigError
from .models.costs import device_profile
from .progress import progress as _progress  # (tests count its advances: sweep._progress)
from .scenario import Scenario, parse_value
from .simulator.files import write_atomic

# what a point is of (each one not varied by the grid becomes a column after the grid's)
DESCRIBE = ["model", "precision", "device", "world_size"]
COLUMNS = ["peak_bytes", "first_step_peak_bytes", "steady_peak_bytes", "capacity_needed_bytes", "peak_op",
           "peak_phase", "peak_step", "step_time_s", "budget_bytes", "fits", "max_micro_batch", "error"]
# with a deadline (peakledger/deadline.py plan_point, and the rank among the points)
DEADLINE_COLUMNS = ["target_tokens", "tokens_per_step", "steps_needed", "step_time_used_s", "step_time_source",
                    "wall_clock_h", "deadline_h", "meets_deadline", "late_by_h", "over_budget_bytes", "gpu_hours",
                    "meets_both", "deadline_rank", "verdict"]

ENGINES = ("local", "ray", "dask")
# engine -> (the module it needs, the extra that installs it)
_EXTRAS = {"ray": ("ray", "peakledger[ray]"), "dask": ("distributed", "peakledger[dask]")}
_CHUNKS_PER_WORKER = 16  # chunks a worker gets on average: balances the load, keeps per-task overhead small
_CHUNK_MAX = 8  # points in one cluster task at most
_POLL_S = 0.1  # seconds between looks at a cluster's progress (and at signals)


@dataclass(frozen=True)
class SweepPoint:
    values: dict
    result: dict


def parse_grid(items: list[str]) -> dict[str, list]:
    """["micro_batch=1,2,4", "precision=fp32,bf16-mixed"] -> {"micro_batch": [1, 2, 4], ...}."""
    grid: dict[str, list] = {}
    for item in items:
        key, eq, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key or not values.strip():
            raise ConfigError("grid", f"expected key=value1,value2,... got {item!r}")
        if key in grid:
            raise ConfigError("grid", f"{key} is given twice")
        grid[key] = [parse_value(v.strip()) for v in values.split(",") if v.strip()]
    if not grid:
        raise ConfigError("grid", "give at least one --grid key=value1,value2")
    return grid


def points(grid: dict[str, list]) -> list[dict]:
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def describe(base: Scenario) -> dict:
    """The DESCRIBE columns of the base scenario (a grid that varies one of them has its own column instead)."""
    return {"model": base.model.name, "precision": base.setup.precision, "device": base.device,
            "world_size": base.setup.world_size}


def _evaluate(task: tuple[Scenario, dict, int | None, bool, dl.DeadlineBudget | None]) -> dict:
    base, values, budget, max_batch, deadline = task
    out = {**describe(base), **{c: "" for c in COLUMNS + (DEADLINE_COLUMNS if deadline else [])}}
    try:
        scenario = base.with_changes(**values)
        report = api.run(scenario)
        if budget is None and deadline is not None:  # the point's own device: its capacity
            budget = device_profile(scenario.device).memory_bytes
    except ConfigError as e:
        out["error"] = str(e)
        if deadline is not None:
            out["verdict"] = dl.INVALID
        return out
    pk = report.peaks
    out.update(peak_bytes=pk.peak.bytes, first_step_peak_bytes=pk.first_step.bytes,
               steady_peak_bytes=pk.steady.bytes if pk.steady else "", capacity_needed_bytes=report.capacity_needed,
               peak_op=pk.peak.event.op if pk.peak.event else "", peak_phase=pk.peak.event.phase.value
               if pk.peak.event else "", peak_step=pk.peak.event.step if pk.peak.event else "",
               step_time_s=report.time_per_step_s)
    if budget is not None:
        out["budget_bytes"] = budget
        out["fits"] = api.fits(report, budget)  # on a GPU profile: the caching allocator within the budget
        if max_batch:
            out["max_micro_batch"] = api.max_micro_batch(scenario, budget)
    if deadline is not None:
        s = scenario.setup
        step_time, source = dl.steady_step_seconds(report.log) if deadline.step_time_s is None else (0.0, "")
        out.update(dl.plan_point(deadline, tokens=dl.tokens_per_step(s.micro_batch, s.seq_len, s.grad_accum, s.dp),
                                 step_time_s=step_time, step_time_source=source, world_size=s.world_size,
                                 capacity_needed=report.capacity_needed, fits=out["fits"], memory_bytes=budget))
    return out


def _evaluate_chunk(tasks: list) -> list[dict]:
    """One task of a pool or cluster: consecutive points, so the base scenario is sent once per chunk."""
    return [_evaluate(t) for t in tasks]


def check_engine(engine: str, address: str | None = None, jobs: int | None = None) -> None:
    """Refuse an unknown engine, a missing optional package, an address without a cluster engine and a
    `jobs` that is not a positive integer, before any work."""
    if engine not in ENGINES:
        raise ConfigError("engine", f"unknown engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ConfigError("jobs", f"the number of worker processes must be a positive integer (1, 2, ...), "
                                  f"got {jobs!r}")
    if address is not None:
        if engine == "local":
            raise ConfigError("address", "an existing cluster's address needs engine ray or dask; "
                                         "the local engine runs on this machine's cores")
        if not isinstance(address, str) or not address.strip():
            raise ConfigError("address", f"expected a cluster address (ray: host:port or auto; dask: "
                                         f"tcp://host:port), got {address!r}")
        if jobs is not None:
            raise ConfigError("jobs", "sizes the local cluster a run starts; an existing cluster (address) "
                                      "runs on the workers it has: drop jobs")
    if engine in _EXTRAS:
        module, extra = _EXTRAS[engine]
        if importlib.util.find_spec(module) is None:
            raise ConfigError("engine", f"engine {engine} needs the {module} package: pip install '{extra}'")


def run_sweep(base: Scenario, grid: dict[str, list], budget: int | None = None, max_batch: bool = False,
              jobs: int | None = None, progress: bool = True, engine: str = "local",
              address: str | None = None, deadline: dl.DeadlineBudget | None = None) -> list[SweepPoint]:
    """Simulate every grid point on `engine` (see the module docstring); results in grid order. With `deadline`
    each point has the deadline columns and its `deadline_rank` among the points (peakledger/deadline.py)."""
    check_engine(engine, address, jobs)
    if deadline is not None and not isinstance(deadline, dl.DeadlineBudget):
        raise ConfigError("deadline", f"expected a DeadlineBudget, got {type(deadline).__name__}")
    if deadline is not None and deadline.memory_bytes is not None:
        if budget is not None and budget != deadline.memory_bytes:
            raise ConfigError("budget", f"two memory budgets: {budget} bytes and the deadline's {deadline.memory_bytes}"
                                        "; give one")
        budget = deadline.memory_bytes
    if max_batch and budget is None and deadline is None:
        raise ConfigError("budget", "--max-batch needs --budget")
    unknown = sorted(set(grid) - base.settings())
    if unknown:  # a misspelt field is an error, not a grid of error rows
        raise ConfigError("grid", f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(base.settings()))}")
    pts = points(grid)
    tasks = [(base, p, budget, max_batch, deadline) for p in pts]
    if not tasks:
        return []
    workers = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    run = {"local": _run_local, "ray": _run_ray, "dask": _run_dask}[engine]
    with _Interrupts(), _progress("simulating the grid", total=len(tasks), enabled=progress) as bar:
        results = run(tasks, workers, address, bar)
    if deadline is not None:  # the ranking needs every point: here, once they are all back, on every engine
        for place, i in enumerate(dl.rank_points(results), start=1):
            results[i]["deadline_rank"] = place
    return [SweepPoint(values=p, result=r) for p, r in zip(pts, results)]


# --- engines: each takes the tasks, the worker count (of a local cluster), the address and the bar
# (advanced per finished task); it returns the results in task order and cleans up on every exit path.

def _run_local(tasks: list, workers: int, address: None, bar: _progress) -> list[dict]:
    if workers == 1:
        results = []
        for t in tasks:
            results.append(_evaluate(t))
            bar.advance()
        return results
    pool = None
    try:
        # both signals blocked while forking: a worker unblocks them in _pool_worker_init, once it ignores SIGINT;
        # one that came meanwhile reaches this process when the block ends
        with _blocked(signal.SIGINT, signal.SIGTERM):
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_pool_worker_init)
        chunks = _chunks(tasks, workers, most=None)
        it = pool.imap(_evaluate_chunk, chunks)  # chunk by chunk, in order (chunksize 1: next() takes a timeout)
        results = []
        for _ in chunks:
            while True:
                try:  # wake every _POLL_S: a signal another thread took is handled here, not after the chunk
                    part = it.next(timeout=_POLL_S)
                    break
                except multiprocessing.TimeoutError:
                    continue
            results.extend(part)
            bar.advance(len(part))
        return results
    finally:
        if pool is not None:
            pool.terminate()  # SIGTERM to each worker, then joins them all: no process outlives the sweep
            pool.join()


def _pool_worker_init() -> None:
    """A local pool worker ignores SIGINT (Ctrl-C is the parent's to handle; it terminates the pool) and
    dies quietly on SIGTERM (the parent's SIGTERM handler is inherited through fork)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _chunks(tasks: list, workers: int, most: int | None = _CHUNK_MAX) -> list[list]:
    """Consecutive tasks per pool or cluster task: about _CHUNKS_PER_WORKER per worker, at most `most` points
    on a cluster (a worker finishes its chunk before it stops, so a small chunk keeps Ctrl-C quick; the local
    pool's terminate() stops a worker mid-chunk, so it takes no cap)."""
    size = max(1, len(tasks) // (workers * _CHUNKS_PER_WORKER))
    size = size if most is None else min(most, size)
    return [tasks[i:i + size] for i in range(0, len(tasks), size)]


def _gather(chunks: list[list], handles: list, finished, key, result, bar: _progress) -> list[dict]:
    """Collect chunk results in the order they finish (`finished` yields the handles, `key(handle)` is
    hashable, `result(handle)` is the chunk's rows), put them back in chunk order, flatten."""
    index = {key(h): i for i, h in enumerate(handles)}
    done: list = [None] * len(chunks)
    for h in finished:
        i = index[key(h)]
        done[i] = result(h)
        bar.advance(len(chunks[i]))
    return [r for chunk in done for r in chunk]


def _run_ray(tasks: list, workers: int, address: str | None, bar: _progress) -> list[dict]:
    if address is None:
        # a throwaway cluster: loopback only (ray reads this when it is first imported), no usage statistics
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    options = dict(logging_level=logging.ERROR, log_to_driver=False)
    if address is None:
        options.update(num_cpus=workers, include_dashboard=False)
    else:
        options.update(address=address)
    callers = ray.is_initialized()  # a session the caller opened is used as it is, and kept open
    with contextlib.nullcontext() if callers else _in_helper_thread(lambda: ray.init(**options), ray.shutdown):
        with _SigtermBetweenCalls() as sigterm:
            if address is not None or callers:
                workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
            chunks = _chunks(tasks, workers)
            remote = ray.remote(num_cpus=1)(_evaluate_chunk)
            refs = [remote.remote(c) for c in chunks]
            try:
                return _gather(chunks, refs, _ray_finished(ray, refs, sigterm), lambda r: r, ray.get, bar)
            except BaseException:
                for ref in refs:  # interrupted or failed: stop what still runs
                    with contextlib.suppress(Exception):
                        ray.cancel(ref, force=True)
                raise


def _ray_finished(ray, refs: list, sigterm: _SigtermBetweenCalls):
    """The refs as they finish. The waiting is a Python sleep, where Python handles signals: inside a ray
    call, a Ctrl-C comes out as a bare KeyboardInterrupt (ray/_raylet.pyx, check_status)."""
    pending = list(refs)
    while pending:
        sigterm.check()
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
        if not ready:
            time.sleep(_POLL_S)
        yield from ready


CONNECT_TIMEOUT_S = 20  # dask: how long a given scheduler address may take to answer


def _run_dask(tasks: list, workers: int, address: str | None, bar: _progress) -> list[dict]:
    from distributed import Client, LocalCluster, as_completed

    started: dict = {}

    def start() -> None:
        if address is None:
            # CRITICAL: a worker busy with its last chunk when the sweep stops logs lost-scheduler errors
            started["cluster"] = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                              host="127.0.0.1", dashboard_address=None, silence_logs=logging.CRITICAL)
        if address is None:
            started["client"] = Client(started["cluster"], set_as_default=False)
            return
        try:  # an address the user gave: one that does not answer (or answers as no scheduler does) is theirs
            started["client"] = Client(address, set_as_default=False, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, MemoryError, ValueError) as e:
            raise ConfigError("address", f"no dask scheduler answered at {address} within {CONNECT_TIMEOUT_S} s "
                                         f"({type(e).__name__}); give a running scheduler's tcp://host:port, or "
                                         "leave --address out for a local cluster") from None

    def stop() -> None:
        try:
            if "client" in started:
                started["client"].close()
        finally:
            if "cluster" in started:
                started["cluster"].close()

    if address is None:
        # multiprocessing starts its resource tracker with the first spawned process and then unblocks SIGINT
        # in the thread that spawned it (multiprocessing/resource_tracker.py, ensure_running), so the workers
        # would not inherit the block: start it here, first.
        resource_tracker.ensure_running()
    with _in_helper_thread(start, stop):
        client = started["client"]
        if address is not None:
            workers = max(1, sum(w.get("nthreads", 1) for w in client.scheduler_info()["workers"].values()))
        chunks = _chunks(tasks, workers)
        futures = [client.submit(_evaluate_chunk, c, pure=False) for c in chunks]
        try:
            return _gather(chunks, futures, as_completed(futures, loop=client.loop), lambda f: f.key,
                           lambda f: f.result(), bar)
        except BaseException:
            with contextlib.suppress(Exception):  # interrupted or failed: stop what still runs
                client.cancel(futures, force=True)
            raise


# --- signals and progress

class _Interrupts:
    """During a sweep SIGTERM raises KeyboardInterrupt, like Ctrl-C, so one clean-up serves both (a SIGTERM
    handler the caller installed, such as the CLI's, is kept instead; only the main thread has handlers)."""

    def __enter__(self) -> _Interrupts:
        main = threading.current_thread() is threading.main_thread()
        self.installed = main and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
        if self.installed:
            self.previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _in_helper_thread(start, stop):
    """A cluster's life in a helper thread that blocks SIGINT: start() there, the block's body here, then stop()
    there. Why a thread: the processes it starts inherit the mask (through fork and exec), so a terminal's
    Ctrl-C, which reaches the whole process group, gives them no traceback; ray ties the processes it starts
    to the life of the starting thread (PR_SET_PDEATHSIG), so that thread lives until stop(); and off the main
    thread ray.init leaves the process's SIGTERM handler alone. An interrupt (Ctrl-C, SIGTERM) while the
    cluster starts or stops is held until it is done, so none is left half-started; a second one (or one
    during the stop of an interrupted sweep) stops waiting."""
    ready, finish = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def life() -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            start()
        except BaseException as e:  # raised in the caller's thread
            errors.append(e)
        ready.set()
        if not errors:
            finish.wait()
        try:
            stop()  # whatever start() made, even half of it
        except Exception as e:  # raised in the caller's thread
            errors.append(e)

    helper = threading.Thread(target=life, name="peakledger-sweep-cluster", daemon=True)
    helper.start()
    try:
        _wait(ready.wait, hold=True)
        if errors:
            raise errors[0]
        yield
    finally:
        finish.set()
        _wait(lambda timeout: helper.join(timeout) or not helper.is_alive(), hold=sys.exc_info()[0] is None)
    if errors:
        raise errors[0]


def _wait(done, hold: bool) -> None:
    """Wait until done(timeout) is true, in short waits so that signals are handled. hold=True: the first
    interrupt is raised only once done, a second one at once; hold=False: any interrupt at once."""
    held = None
    while True:
        try:
            if done(_POLL_S):
                break
        except BaseException as e:  # Ctrl-C, or a SIGTERM handler's exception
            if not hold or held is not None:
                raise
            held = e
    if held is not None:
        raise held


@contextlib.contextmanager
def _blocked(*signums: int):
    """Block signals in this thread while it forks workers (they inherit the mask); one that comes meanwhile
    is delivered when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(signums)) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _SigtermBetweenCalls:
    """While ray runs a sweep, a SIGTERM only sets a flag, and `check()` (between ray calls) and the exit
    raise it through the handler it replaced (ours, or the caller's with its own exception): an exception
    raised inside ray's C code comes out as a bare KeyboardInterrupt (ray/_raylet.pyx, check_status), which
    would turn the CLI's "terminated" into "interrupted". Installing a handler also takes SIGTERM back
    from ray's core worker, which puts its own C-level one in the driver process (it prints `*** SIGTERM
    received ***`). Only the main thread has handlers; elsewhere nothing changes."""

    def __enter__(self) -> _SigtermBetweenCalls:
        self.seen = False
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            self.handler = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.seen = True

    def check(self) -> None:
        if self.seen:
            self.seen = False
            if callable(self.handler):
                self.handler(signal.SIGTERM, None)
            if self.handler != signal.SIG_IGN:
                raise KeyboardInterrupt("SIGTERM")

    def __exit__(self, *exc) -> None:
        if self.main:
            signal.signal(signal.SIGTERM, self.handler if self.handler is not None else signal.SIG_DFL)
        self.check()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")




def result_columns(sweep: list[SweepPoint]) -> list[str]:
    """The result columns the points have, in order: DESCRIBE, COLUMNS, and DEADLINE_COLUMNS with a deadline."""
    first = sweep[0].result if sweep else {}
    return DESCRIBE + COLUMNS + (DEADLINE_COLUMNS if "verdict" in first else []) if first else COLUMNS


def to_csv(sweep: list[SweepPoint]) -> str:
    keys = list(sweep[0].values) if sweep else []
    columns = [c for c in result_columns(sweep) if c not in keys]  # a field the grid varies is its column
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(keys + columns)
    for p in sweep:
        w.writerow([_cell(p.values[k]) for k in keys] + [p.result[c] for c in columns])
    return buf.getvalue()


def to_json(sweep: list[SweepPoint], base: Scenario, grid: dict[str, list],
            deadline: dl.DeadlineBudget | None = None) -> str:
    columns = [c for c in result_columns(sweep) if c not in DESCRIBE]
    return json.dumps({"scenario": base.name, **describe(base),
                       "grid": {k: [_cell(v) for v in vs] for k, vs in grid.items()}, "unit": "B",
                       **({"deadline": deadline.as_json()} if deadline is not None else {}),
                       "points": [{"values": {k: _cell(v) for k, v in p.values.items()},
                                   **{c: p.result[c] for c in columns}} for p in sweep]},
                      indent=1, default=str) + "\n"


def _cell(value):
    return value if isinstance(value, (int, float, str, bool)) else str(value)


def write(sweep: list[SweepPoint], base: Scenario, grid: dict[str, list], csv_path: str | None,
          json_path: str | None, deadline: dl.DeadlineBudget | None = None) -> None:
    if csv_path:
        write_atomic(csv_path, to_csv(sweep).encode())
    if json_path:
        write_atomic(json_path, to_json(sweep, base, grid, deadline).encode())


__all__ = ["parse_grid", "points", "run_sweep", "check_engine", "to_csv", "to_json", "write", "describe",
           "result_columns", "COLUMNS", "DESCRIBE", "DEADLINE_COLUMNS", "ENGINES"]
