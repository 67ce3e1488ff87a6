"""The local engine's pool: `workers` forked processes that run consecutive ranges of the sweep's points, and survive
the loss of a worker.

Each worker is a fork of this process, so it has the task list already (nothing is pickled on the way out); it gets
a range of point indices through its pipe and sends one message per point back: (index, row, seconds). The parent
waits on every worker's pipe and its process `sentinel` at once (multiprocessing.connection.wait, in POLL_S waits so
that signals and the time limit are handled), so it knows at once when a worker dies, and which point it was running
(the first of its range not yet back). A worker that dies (SIGKILL from the kernel's out-of-memory killer, any fatal
signal, an exit) is replaced by a fresh fork, and the points of its range not yet back go to the front of the queue;
a point whose worker has died MAX_ATTEMPTS times fails the sweep with one line naming the point and how its worker
died, so a point that kills its worker cannot loop forever; workers dying while idle end it after
2 x workers + 2 deaths. A point that raises MemoryError fails the sweep the same way (the environment's, not a bug);
another exception in a point (a bug) is raised again here.

Workers ignore SIGINT (Ctrl-C is the parent's), die quietly on SIGTERM, are forked with SIGINT and SIGTERM blocked
(a signal that comes meanwhile reaches the parent when the block ends), and close every pipe end but their own, so
the parent's death is an end of file for them. Every worker is stopped on every exit path (SIGTERM, then SIGKILL
after STOP_S) and joined. (What a run of points leaves in reference cycles is collected by the simulator's paused
collector, simulator/gcpause.py, in every process alike.)
"""

from __future__ import annotations

import collections
import multiprocessing
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from ..models.config import ConfigError
from .bounds import Tracker
from .point import evaluate
from .signals import POLL_S, blocked

MAX_ATTEMPTS = 2  # a point whose worker died this many times fails the sweep
STOP_S = 2.0  # a worker's time to die after SIGTERM before SIGKILL


@dataclass(eq=False)
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    span: range | None = None  # the range it runs (None: idle)
    next: int = 0  # the first index of `span` not yet back


@dataclass
class _Pool:
    tasks: list
    results: list
    tracker: Tracker
    evaluate: Callable
    size: int  # workers it keeps running
    workers: list[_Worker] = field(default_factory=list)
    queue: collections.deque = field(default_factory=collections.deque)
    attempts: collections.Counter = field(default_factory=collections.Counter)
    idle_deaths: int = 0
    seconds: list[float] = field(default_factory=list)

    def start_worker(self) -> _Worker:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe(duplex=True)
        others = [w.conn for w in self.workers] + [parent]
        # the worker unblocks them once it ignores SIGINT; here one that comes meanwhile is raised once the worker
        # is in self.workers, which stop() ends
        with blocked(signal.SIGINT, signal.SIGTERM):
            process = ctx.Process(target=_worker_main, args=(child, others, self.tasks, self.evaluate),
                                  name="peakledger-sweep-worker", daemon=True)
            try:
                process.start()
            finally:
                child.close()
            worker = _Worker(process, parent)
            self.workers.append(worker)
        return worker

    def assign(self) -> None:
        for w in self.workers:
            if w.span is None and self.queue:
                w.span = self.queue.popleft()
                w.next = w.span.start
                try:
                    w.conn.send((w.span.start, w.span.stop))
                except OSError:  # it died meanwhile: its sentinel says so next
                    pass

    def receive(self, w: _Worker) -> bool:
        """Take what `w` sent; False once its pipe has ended (it died, or is dying)."""
        try:
            while w.conn.poll():
                kind, index, payload, seconds = w.conn.recv()
                if kind == "error":
                    self.raise_error(index, payload)
                self.results[index] = payload
                self.seconds.append(seconds)
                w.next = index + 1
                self.tracker.advance()
                if w.next == w.span.stop:
                    w.span = None
        except (EOFError, OSError):
            return False
        return True

    def raise_error(self, index: int, error: BaseException) -> None:
        if isinstance(error, MemoryError):
            raise ConfigError("grid", f"the point {point_values(self.tasks[index])} ran out of memory in its worker "
                                      "process; nothing written; leave it out of the grid or give the sweep more "
                                      "memory (fewer --jobs)")
        raise error

    def died(self, w: _Worker) -> None:
        """`w` is dead: its remaining points back to the front of the queue, a fresh worker in its place."""
        self.receive(w)  # what it sent before it died
        w.process.join()
        w.conn.close()
        self.workers.remove(w)
        how = _how(w.process.exitcode)
        if w.span is None:
            self.idle_deaths += 1
            if self.idle_deaths > 2 * self.size + 2:
                raise ConfigError("jobs", f"the sweep's worker processes keep dying ({how}) before they run any "
                                          "point; nothing written; look for what kills them (`dmesg`: the "
                                          "out-of-memory killer) or run with --jobs 1")
        else:
            index = w.next
            self.attempts[index] += 1
            if self.attempts[index] >= MAX_ATTEMPTS:
                raise ConfigError("grid", f"the point {point_values(self.tasks[index])} killed its worker process "
                                          f"{times(self.attempts[index])} ({how}{_OOM if how == 'SIGKILL' else ''}); "
                                          "nothing written; leave it out of the grid or give the sweep more memory "
                                          "(fewer --jobs)")
            self.queue.appendleft(range(index, w.span.stop))
        self.start_worker()

    def run(self, spans: list[range]) -> None:
        """Run `spans` to the end (results[i] filled for each of their points), handling deaths and the limit."""
        self.queue.extend(spans)
        pending = sum(len(s) for s in spans)
        target = self.tracker.done + pending
        while self.tracker.done < target:
            self.assign()
            busy = {w.conn: w for w in self.workers}
            sentinels = {w.process.sentinel: w for w in self.workers}
            ready = wait(list(busy) + list(sentinels), timeout=POLL_S)
            dead = []
            for r in ready:
                if r in busy:
                    if not self.receive(busy[r]):
                        dead.append(busy[r])
                elif sentinels[r] not in dead:
                    dead.append(sentinels[r])
            for w in dict.fromkeys(dead):
                self.died(w)
            self.tracker.check()

    def stop(self) -> None:
        """Every worker stopped and joined, whatever state it is in."""
        for w in self.workers:
            w.conn.close()  # an idle worker ends at the end of file
            if w.process.is_alive():
                w.process.terminate()
        end = time.monotonic() + STOP_S
        for w in self.workers:
            w.process.join(max(0.0, end - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
        self.workers.clear()


_OOM = ": what the kernel's out-of-memory killer sends, see `dmesg`"


def run_pool(tasks: list, workers: int, tracker: Tracker, chunks: Callable[[int, int, int], list[range]],
             evaluate_point: Callable | None = None) -> list[dict]:
    """The tasks' rows, in task order, run on `workers` forked processes: first the tracker's probe points (timed,
    one range per worker, then the estimate), then the rest in `chunks(start, stop, workers)` ranges. Each point
    is `evaluate_point(task)` (default: point.evaluate, as this module has it when called)."""
    pool = _Pool(tasks, [None] * len(tasks), tracker, evaluate_point or evaluate, workers)
    try:
        for _ in range(workers):
            pool.start_worker()
        probe = tracker.probe_spans(workers)
        if probe:
            pool.run(probe)
            tracker.estimated(pool.seconds, workers)
        pool.run(chunks(probe[-1].stop if probe else 0, len(tasks), workers))
        return pool.results
    finally:
        pool.stop()


def _worker_main(conn: Connection, others: list[Connection], tasks: list, evaluate_point: Callable) -> None:
    """A worker: ranges in, one (kind, index, row or error, seconds) per point out, until the end of file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for c in others:  # the parent's ends: its death must be an end of file here
        c.close()
    try:
        while True:
            start, stop = conn.recv()
            for i in range(start, stop):
                t = time.perf_counter()
                try:
                    row = evaluate_point(tasks[i])
                except Exception as e:  # a bug or MemoryError: the parent raises it
                    conn.send(("error", i, _picklable(e), 0.0))
                    return
                conn.send(("row", i, row, time.perf_counter() - t))
    except (EOFError, OSError):  # the parent has gone or closed the pipe: nothing more to do
        return


def _picklable(e: Exception) -> Exception:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def point_values(task: tuple) -> str:
    """A task's grid values in words: `micro_batch=4, seq_len=16`."""
    return ", ".join(f"{k}={v}" for k, v in task[1].items())


def times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


__all__ = ["MAX_ATTEMPTS", "STOP_S", "run_pool", "point_values", "times"]
