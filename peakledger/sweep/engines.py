"""Where a sweep's points run: each engine takes the tasks, the worker count (of a local cluster), the address and
the progress bar (advanced per finished task); it returns the results in task order and cleans up on every exit
path (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from multiprocessing import resource_tracker

from ..models.config import ConfigError
from ..progress import progress as _progress
from .point import evaluate, evaluate_chunk
from .signals import POLL_S, SigtermBetweenCalls, blocked, in_helper_thread

_CHUNKS_PER_WORKER = 16  # chunks a worker gets on average: balances the load, keeps per-task overhead small
_CHUNK_MAX = 8  # points in one cluster task at most


def _run_local(tasks: list, workers: int, address: None, bar: _progress) -> list[dict]:
    if workers == 1:
        results = []
        for t in tasks:
            results.append(evaluate(t))
            bar.advance()
        return results
    pool = None
    try:
        # both signals blocked while forking: a worker unblocks them in _pool_worker_init, once it ignores SIGINT;
        # one that came meanwhile reaches this process when the block ends
        with blocked(signal.SIGINT, signal.SIGTERM):
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_pool_worker_init)
        chunks = _chunks(tasks, workers, most=None)
        it = pool.imap(evaluate_chunk, chunks)  # chunk by chunk, in order (chunksize 1: next() takes a timeout)
        results = []
        for _ in chunks:
            while True:
                try:  # wake every POLL_S: a signal another thread took is handled here, not after the chunk
                    part = it.next(timeout=POLL_S)
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
    with contextlib.nullcontext() if callers else in_helper_thread(lambda: ray.init(**options), ray.shutdown):
        with SigtermBetweenCalls() as sigterm:
            if address is not None or callers:
                workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
            chunks = _chunks(tasks, workers)
            remote = ray.remote(num_cpus=1)(evaluate_chunk)
            refs = [remote.remote(c) for c in chunks]
            try:
                return _gather(chunks, refs, _ray_finished(ray, refs, sigterm), lambda r: r, ray.get, bar)
            except BaseException:
                for ref in refs:  # interrupted or failed: stop what still runs
                    with contextlib.suppress(Exception):
                        ray.cancel(ref, force=True)
                raise


def _ray_finished(ray, refs: list, sigterm: SigtermBetweenCalls):
    """The refs as they finish. The waiting is a Python sleep, where Python handles signals: inside a ray
    call, a Ctrl-C comes out as a bare KeyboardInterrupt (ray/_raylet.pyx, check_status)."""
    pending = list(refs)
    while pending:
        sigterm.check()
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
        if not ready:
            time.sleep(POLL_S)
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
    with in_helper_thread(start, stop):
        client = started["client"]
        if address is not None:
            workers = max(1, sum(w.get("nthreads", 1) for w in client.scheduler_info()["workers"].values()))
        chunks = _chunks(tasks, workers)
        futures = [client.submit(evaluate_chunk, c, pure=False) for c in chunks]
        try:
            return _gather(chunks, futures, as_completed(futures, loop=client.loop), lambda f: f.key,
                           lambda f: f.result(), bar)
        except BaseException:
            with contextlib.suppress(Exception):  # interrupted or failed: stop what still runs
                client.cancel(futures, force=True)
            raise



ENGINES = {"local": _run_local, "ray": _run_ray, "dask": _run_dask}

__all__ = ["ENGINES", "CONNECT_TIMEOUT_S"]
