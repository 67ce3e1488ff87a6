"""Where a sweep's points run: each engine takes the tasks, the worker count (of a local cluster), the address and
the run's Tracker (peakledger/sweep/bounds.py: the progress bar, advanced per finished point or chunk, the time
limit, the estimate); it returns the rows in task order and cleans up on every exit path (see the package docstring).

Every engine first runs the tracker's probe points (a few on each worker, timed), makes the estimate (which may
refuse the rest), then the rest; it checks the time limit at each look at its workers (every POLL_S).

A worker lost mid-sweep: the local pool (peakledger/sweep/pool.py) gives the points it had not finished to a fresh
worker, up to pool.MAX_ATTEMPTS times for a point; ray retries a task whose worker died (max_retries), dask's
scheduler a task whose worker died (allowed-failures); a local ray or dask cluster allows MAX_ATTEMPTS tries in all.
A task that still fails so fails the sweep with one line naming its points, nothing returned.

A cluster address is parsed and probed first (peakledger/sweep/address.py), and a cluster's start or connection is
bounded in time (CLUSTER_START_TIMEOUT_S for a local one, CONNECT_TIMEOUT_S for an existing one) even if the library
hangs; an interrupt while connecting to an existing cluster takes effect at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

from ..models.config import ConfigError
from .address import check_address
from .bounds import Tracker
from .point import evaluate
from .pool import MAX_ATTEMPTS, point_values, run_pool
from .signals import POLL_S, SigtermBetweenCalls, in_helper_thread

_CHUNKS_PER_WORKER = 16  # chunks a worker gets on average: balances the load, keeps per-task overhead small
_CHUNK_MAX = 8  # points in one cluster task at most
CLUSTER_START_TIMEOUT_S = 120.0  # a local ray or dask cluster's start at most (~10 s and ~3 s on 2 cores)
CONNECT_TIMEOUT_S = 30.0  # the connection to an existing cluster at most, once its address has answered the probe


def evaluate_timed_chunk(tasks: list) -> list[tuple[dict, float]]:
    """One cluster task: consecutive points (the base scenario sent once per chunk), each row with its seconds."""
    out = []
    for t in tasks:
        start = time.perf_counter()
        out.append((evaluate(t), time.perf_counter() - start))
    return out


def _run_inline(tasks: list, tracker: Tracker) -> list[dict]:
    """jobs=1: every point here, in order; the time limit is checked between points."""
    rows, seconds = [], []
    probe = tracker.probe_size(1)
    for i, t in enumerate(tasks):
        start = time.perf_counter()
        rows.append(evaluate(t))
        seconds.append(time.perf_counter() - start)
        tracker.advance()
        if i + 1 == probe:
            tracker.estimated(seconds, 1)
        tracker.check()
    return rows


def _run_local(tasks: list, workers: int, address: None, tracker: Tracker) -> list[dict]:
    if workers == 1:
        return _run_inline(tasks, tracker)
    return run_pool(tasks, workers, tracker, lambda start, stop, n: _spans(start, stop, n, most=None))


def _spans(start: int, stop: int, workers: int, most: int | None = _CHUNK_MAX) -> list[range]:
    """Consecutive points per pool or cluster task: about _CHUNKS_PER_WORKER per worker, at most `most` points
    on a cluster (a worker finishes its chunk before it stops, so a small chunk keeps Ctrl-C quick; the local
    pool's workers are stopped mid-chunk, so it takes no cap)."""
    size = max(1, (stop - start) // (workers * _CHUNKS_PER_WORKER))
    size = size if most is None else min(most, size)
    return [range(i, min(stop, i + size)) for i in range(start, stop, size)]


def _run_on_cluster(tasks: list, workers: int, tracker: Tracker, submit: Callable[[list], object],
                    finished: Callable[[list], Iterator], key: Callable[[object], object],
                    result: Callable[[object], list[tuple[dict, float]]], lost: Callable[[BaseException], str | None],
                    cancel: Callable[[list], None]) -> list[dict]:
    """The probe spans, the estimate, then the rest, each span a task: `submit(tasks)` gives its handle, `finished`
    yields handles as they finish (checking the tracker), `result(handle)` is its rows; `lost(e)` says in words how
    an exception from result() means the task's worker was lost (None: not that, raised as it is). What still
    runs is cancelled on every exit path but the normal one."""
    rows: list = [None] * len(tasks)
    seconds: list[float] = []
    submitted: list = []

    def run(spans: list[range]) -> None:
        handles = [submit(tasks[s.start:s.stop]) for s in spans]
        submitted.extend(handles)
        span_of = {key(h): s for h, s in zip(handles, spans)}
        for h in finished(handles):
            span = span_of[key(h)]
            try:
                out = result(h)
            except Exception as e:
                how = lost(e)
                if how is None:
                    raise
                one = len(span) == 1
                raise ConfigError("grid", f"{_span_words(tasks, span)} lost {'its' if one else 'their'} worker each "
                                          f"time {'it' if one else 'they'} ran ({how}); nothing written; leave "
                                          f"{'it' if one else 'them'} out of the grid or give the cluster's workers "
                                          "more memory") from None
            for i, (row, s) in zip(span, out):
                rows[i] = row
                seconds.append(s)
            tracker.advance(len(span))

    try:
        probe = tracker.probe_spans(workers)
        if probe:
            run(probe)
            tracker.estimated(seconds, workers)
        run(_spans(probe[-1].stop if probe else 0, len(tasks), workers))
        return rows
    except BaseException:
        with contextlib.suppress(Exception):  # interrupted or failed: stop what still runs
            cancel(submitted)
        raise


def _span_words(tasks: list, span: range) -> str:
    """`the point a=1` / `the points a=1; a=2; a=3 (one task)` / `the 8 points from a=1 to a=8 (one task)`."""
    if len(span) == 1:
        return f"the point {point_values(tasks[span.start])}"
    if len(span) <= 3:
        return "the points " + "; ".join(point_values(tasks[i]) for i in span) + " (one task)"
    return (f"the {len(span)} points from {point_values(tasks[span.start])} to {point_values(tasks[span.stop - 1])} "
            "(one task)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _run_ray(tasks: list, workers: int, address: str | None, tracker: Tracker) -> list[dict]:
    target = check_address("ray", address) if address is not None else None
    if target is not None and address == "auto":
        # ray resolves auto as check_address did (the same RAY_ADDRESS, the same file), and only then enables
        # its token authentication (ray/_private/worker.py (2.60.0) init: "address in (None, 'auto')")
        target = "auto"
    if address is None:
        # a throwaway cluster: loopback only (ray reads this when it is first imported), no usage statistics
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    options: dict = dict(logging_level=logging.ERROR, log_to_driver=False)
    if target is None:
        # ray retries a task whose worker died: MAX_ATTEMPTS tries in all, those lost to ray's out-of-memory killer
        # included (ray/_private/worker.py (2.60.0) init: _system_config only on a cluster it starts)
        # "local": a new cluster even where `ray start` left one (ray/_private/worker.py (2.60.0) init: address)
        options.update(address="local", num_cpus=workers, include_dashboard=False,
                       _system_config={"task_oom_retries": MAX_ATTEMPTS - 1})
    else:
        options.update(address=target)
    callers = ray.is_initialized()  # a session the caller opened is used as it is, and kept open

    def start() -> None:
        try:
            ray.init(**options)
        except Exception as e:
            if target is None:
                raise
            raise ConfigError("address", f"ray could not connect to the cluster at {address} ({_first_line(e)}); "
                                         "give a running cluster's host:port (`ray status` on its head node shows "
                                         "it), or leave --address out for a local cluster") from None

    def timed_out() -> BaseException:
        if target is None:
            return ConfigError("engine", f"the local ray cluster did not start within {CLUSTER_START_TIMEOUT_S:g} s;"
                                         " try again, or use --engine local")
        return ConfigError("address", f"the ray cluster at {address} did not accept this sweep within "
                                      f"{CONNECT_TIMEOUT_S:g} s; check that it runs (`ray status` on its head node) "
                                      "and that its version is ray's here, or leave --address out for a local cluster")

    life = contextlib.nullcontext() if callers else in_helper_thread(
        start, ray.shutdown, timeout_s=CLUSTER_START_TIMEOUT_S if target is None else CONNECT_TIMEOUT_S,
        on_timeout=timed_out, hold=target is None)
    with life:
        with SigtermBetweenCalls() as sigterm:
            if address is not None or callers:
                workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
            # a task whose worker died runs again, MAX_ATTEMPTS times in all (ray's default: 4)
            remote = ray.remote(num_cpus=1, max_retries=MAX_ATTEMPTS - 1)(evaluate_timed_chunk)

            def lost(e: BaseException) -> str | None:
                if isinstance(e, ray.exceptions.RayError) and not isinstance(
                        e, (ray.exceptions.RayTaskError, ray.exceptions.TaskCancelledError)):
                    return _first_line(e)
                return None

            def cancel(refs: list) -> None:
                for ref in refs:
                    with contextlib.suppress(Exception):
                        ray.cancel(ref, force=True)

            return _run_on_cluster(tasks, workers, tracker, remote.remote, lambda refs: _ray_finished(
                ray, refs, sigterm, tracker), lambda r: r, ray.get, lost, cancel)


def _ray_finished(ray, refs: list, sigterm: SigtermBetweenCalls, tracker: Tracker) -> Iterator:
    """The refs as they finish. The waiting is a Python sleep, where Python handles signals: inside a ray
    call, a Ctrl-C comes out as a bare KeyboardInterrupt (ray/_raylet.pyx, check_status)."""
    pending = list(refs)
    while pending:
        sigterm.check()
        tracker.check()
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
        if not ready:
            time.sleep(POLL_S)
        yield from ready


def _run_dask(tasks: list, workers: int, address: str | None, tracker: Tracker) -> list[dict]:
    target = check_address("dask", address) if address is not None else None
    import dask
    from distributed import Client, KilledWorker, LocalCluster

    started: dict = {}

    def start() -> None:
        if target is None:
            # a task whose worker died runs again, MAX_ATTEMPTS times in all (distributed/distributed.yaml
            # (2026.8.0): scheduler.allowed-failures, default 3); CRITICAL: a worker busy with its last chunk when
            # the sweep stops logs lost-scheduler errors
            with dask.config.set({"distributed.scheduler.allowed-failures": MAX_ATTEMPTS - 1}):
                started["cluster"] = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                  host="127.0.0.1", dashboard_address=None,
                                                  silence_logs=logging.CRITICAL)
            started["client"] = Client(started["cluster"], set_as_default=False)
            return
        try:  # an address the user gave, which answered the probe as a scheduler does
            started["client"] = Client(target, set_as_default=False, timeout=CONNECT_TIMEOUT_S)
        except Exception as e:
            raise ConfigError("address", f"no dask scheduler accepted this sweep at {address} within "
                                         f"{CONNECT_TIMEOUT_S:g} s ({_first_line(e)}); give a running scheduler's "
                                         "tcp://host:port, or leave --address out for a local cluster") from None

    def stop() -> None:
        try:
            if "client" in started:
                started["client"].close()
        finally:
            if "cluster" in started:
                started["cluster"].close()

    def timed_out() -> BaseException:
        if target is None:
            return ConfigError("engine", f"the local dask cluster did not start within "
                                         f"{CLUSTER_START_TIMEOUT_S:g} s; try again, or use --engine local")
        return ConfigError("address", f"no dask scheduler accepted this sweep at {address} within "
                                      f"{CONNECT_TIMEOUT_S:g} s; give a running scheduler's tcp://host:port, or leave "
                                      "--address out for a local cluster")

    if target is None:
        # multiprocessing starts its resource tracker with the first spawned process and then unblocks SIGINT
        # in the thread that spawned it (multiprocessing/resource_tracker.py, ensure_running), so the workers
        # would not inherit the block: start it here, first.
        resource_tracker.ensure_running()
    with in_helper_thread(start, stop, timeout_s=CLUSTER_START_TIMEOUT_S if target is None else CONNECT_TIMEOUT_S,
                          on_timeout=timed_out, hold=target is None):
        client = started["client"]
        if target is not None:
            workers = max(1, sum(w.get("nthreads", 1) for w in client.scheduler_info()["workers"].values()))

        def lost(e: BaseException) -> str | None:
            return "dask's KilledWorker: its scheduler gave up" if isinstance(e, KilledWorker) else None

        def cancel(futures: list) -> None:
            client.cancel(futures, force=True)

        return _run_on_cluster(tasks, workers, tracker,
                               lambda chunk: client.submit(evaluate_timed_chunk, chunk, pure=False),
                               lambda futures: _dask_finished(futures, tracker), lambda f: f.key,
                               lambda f: f.result(), lost, cancel)


def _dask_finished(futures: list, tracker: Tracker) -> Iterator:
    """The futures as they finish, looked at every POLL_S (a Python sleep: signals are handled at once)."""
    pending = list(futures)
    while pending:
        tracker.check()
        done = [f.done() for f in pending]
        if not any(done):
            time.sleep(POLL_S)
            continue
        ready = [f for f, d in zip(pending, done) if d]
        pending = [f for f, d in zip(pending, done) if not d]
        yield from ready


ENGINES = {"local": _run_local, "ray": _run_ray, "dask": _run_dask}

__all__ = ["ENGINES", "CONNECT_TIMEOUT_S", "CLUSTER_START_TIMEOUT_S", "evaluate_timed_chunk"]
