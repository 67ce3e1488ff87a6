"""The hardening cases of issue 34, one per finding of its campaign (code from data, the fit check, sweeps under
faults, cluster addresses, unbounded work, output faults, deadline prices, readers, user code, flags): each a
command line with the files it needs and what peakledger must do with it now. The Case format is
bench/hardening_cases.py's; a case with a `driver` runs the command itself with its fault (a closed stdout, a
killed worker, a file-size limit, a peer that never answers) and is run as a real command in the tests too.

Used by tests/test_hardening_34.py and bench/hardening.py --cases 34 (the before / after table of
bench/HARDENING.md, section "Issue 34").
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from hardening_cases import REPO, Case, _evil_did_not_run, _evil_module, _text
from hardening_user_code import USER_CODE_CASES

HF_GPT2 = REPO / "examples" / "hf-gpt2-tiny" / "config.json"
LEDGER_HEADER = "time,object,bytes,action,rank\n"


# --- drivers: each runs `cmd` (python -c RUNNER argv...) in `tmp` with a fault -----------------------------

def _popen(cmd, tmp, preexec, **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec, start_new_session=True, **kw)


def _finish(p: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for the command (its whole session killed past `timeout`: subprocess.TimeoutExpired)."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out or "", err)


def closed_stdout(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
    """stdout a pipe whose reader has gone before the first line (`... | true` under set -o pipefail)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = _popen(cmd, tmp, preexec, stdout=w)
    finally:
        os.close(w)
    return _finish(p, timeout)


def file_size_limit(nbytes: int) -> Callable:
    """No file over `nbytes` can be written (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails with EFBIG), as a
    disk that fills up while the outputs are written: the small output fits, the large one does not."""
    def driver(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
        def limits():
            preexec()
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
        p = _popen(cmd, tmp, limits, stdout=subprocess.PIPE)
        return _finish(p, timeout)
    return driver


def fifo_trickle(every_s: float) -> Callable:
    """{tmp}/fifo fed one line every `every_s` seconds for as long as the command reads it."""
    def driver(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
        p = _popen(cmd, tmp, preexec, stdout=subprocess.PIPE)

        def feed():
            try:
                fd = os.open(tmp / "fifo", os.O_WRONLY)  # blocks until the command opens it
                with os.fdopen(fd, "w") as f:
                    f.write(LEDGER_HEADER)
                    for i in range(10_000):
                        if p.poll() is not None:
                            return
                        f.write(f"{i},x{i},1KiB,alloc,0\n")
                        f.flush()
                        time.sleep(every_s)
            except OSError:  # the reader closed it
                return
        threading.Thread(target=feed, daemon=True).start()
        return _finish(p, timeout)
    return driver


class SilentPeer:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte (an HTTP server waiting for
    a request, a firewall's tarpit)."""

    def __enter__(self) -> int:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.server.settimeout(0.1)
        self.held: list[socket.socket] = []
        self.stop = threading.Event()

        def accept() -> None:
            while not self.stop.is_set():
                try:
                    self.held.append(self.server.accept()[0])
                except OSError:
                    continue

        self.thread = threading.Thread(target=accept, daemon=True)
        self.thread.start()
        return self.server.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(1)
        for c in self.held:
            c.close()
        self.server.close()


def silent_peer(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
    """{port}: a SilentPeer's port."""
    with SilentPeer() as port:
        p = _popen([a.replace("{port}", str(port)) for a in cmd], tmp, preexec, stdout=subprocess.PIPE)
        return _finish(p, timeout)


def child_pids(pid: int) -> list[int]:
    """The live (not zombie) child processes of `pid`, oldest first, from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append((int(fields[19]), int(name)))  # (start time, pid)
    return [p for _, p in sorted(found)]


def killed_worker(after_s: float = 1.0, kills: int = 1, every_s: float = 0.5,
                  workers: int = 2) -> Callable[..., subprocess.CompletedProcess]:
    """A driver (bench/hardening.py's `driver(cmd, tmp, timeout, preexec)`): run `cmd` in `tmp` (its own session),
    wait until it has `workers` worker processes (children of the command's process: the local engine's pool), then
    `after_s` seconds more, then SIGKILL its newest worker, `kills` times `every_s` apart (each time the newest: a
    replacement is killed again). The command's exit, stdout and stderr come back; on `timeout` its whole process
    group is killed and subprocess.TimeoutExpired raised."""
    def driver(cmd, tmp, timeout, preexec=None) -> subprocess.CompletedProcess:
        p = _popen(cmd, tmp, preexec, stdout=subprocess.PIPE)
        killed: list[int] = []

        def kill() -> None:
            end = time.monotonic() + timeout
            while len(child_pids(p.pid)) < workers and p.poll() is None and time.monotonic() < end:
                time.sleep(0.02)
            time.sleep(after_s)
            for _ in range(kills):
                kids = child_pids(p.pid)
                if p.poll() is not None or not kids:
                    return
                os.kill(kids[-1], signal.SIGKILL)
                killed.append(kids[-1])
                time.sleep(every_s)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        done = _finish(p, timeout)
        killer.join(5)
        driver.killed = killed  # the pids it killed, for the caller to check
        return done
    return driver


# the command's process remembers its pid; a process forked from it (a local pool worker) SIGKILLs itself when it
# simulates micro_batch=3 (api.run, the same call in every version): a point that kills its worker every time
POISON = ("import os, signal, sys\n"
          "from peakledger import api\n"
          "parent, real = os.getpid(), api.run\n"
          "def run(scenario, *a, **k):\n"
          "    if os.getpid() != parent and scenario.setup.batch.micro_batch == 3:\n"
          "        os.kill(os.getpid(), signal.SIGKILL)\n"
          "    return real(scenario, *a, **k)\n"
          "api.run = run\n")


def poisoned(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
    """The command with POISON run first."""
    p = _popen([cmd[0], "-c", POISON + cmd[2], *cmd[3:]], tmp, preexec, stdout=subprocess.PIPE)
    return _finish(p, timeout)


def no_ray_cluster(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
    """No ray cluster to find: RAY_ADDRESS unset, ray's temporary folder an empty one."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(tmp), TMPDIR=str(tmp))
    p = _popen(cmd, tmp, preexec, stdout=subprocess.PIPE, env=env)
    return _finish(p, timeout)


# --- files ------------------------------------------------------------------------------------------------

def _module_csv() -> bytes:
    path = _evil_module()
    return f"module,seq_len,measured_allocated\n{path}:factory,16,1MiB\n{path}:factory,32,2MiB\n".encode()


def _hf(**changes) -> Callable[[], bytes]:
    def make() -> bytes:
        data = json.loads(HF_GPT2.read_text())
        data.update(changes)
        return json.dumps(data).encode()
    return make


def _calibration(mutate: Callable[[dict], None]) -> Callable[[], bytes]:
    """A calibration of the tiny preset on cpu (fitted here, in process), changed by `mutate`."""
    def make() -> bytes:
        import contextlib
        import io
        import tempfile

        from peakledger.cli import main
        with tempfile.TemporaryDirectory() as d:
            Path(d, "m.csv").write_text("seq_len,measured_allocated\n16,1MiB\n32,2MiB\n")
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(["calibrate", "fit", "--preset", "tiny", "--device", "cpu", "--csv", f"{d}/m.csv",
                             "--output", f"{d}/c.json"]) == 0
            data = json.loads(Path(d, "c.json").read_text())
        mutate(data)
        return json.dumps(data).encode()
    return make


def _residual_huge(d: dict) -> None:
    d["allocated"]["knots"][0]["residual"] = 1e308


def _nested(depth: int) -> Callable[[], bytes]:
    return lambda: ("[" * depth + "]" * depth).encode()


def _nothing_left(*names: str) -> Callable[[str, str, Path], str | None]:
    def check(out, err, tmp):
        left = [n for n in names if (tmp / n).exists()]
        left += [p.name for p in tmp.iterdir() if p.name.startswith(".peakledger-tmp-")]
        return f"left behind: {', '.join(left)}" if left else None
    return check


def _same_rows_as_undisturbed(out, err, tmp) -> str | None:
    """s.csv is byte for byte the sweep of the same grid run undisturbed (in process, one worker)."""
    import contextlib
    import io
    import tempfile

    from peakledger.cli import main
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
        assert main(_undisturbed_argv(f"{d}/ref.csv")) == 0
        ref = Path(d, "ref.csv").read_bytes()
    got = (tmp / "s.csv").read_bytes()
    return None if got == ref else f"s.csv ({len(got.splitlines())} lines) differs from the undisturbed sweep"


def _undisturbed_argv(output: str) -> list[str]:
    """SWEEP_KILLED on one worker, into `output`."""
    at = SWEEP_KILLED.index("--jobs")
    argv = [*SWEEP_KILLED[:at], "--jobs", "1", *SWEEP_KILLED[at + 2:]]
    return [*argv[:-1], output]


def _csv_rows(out, err, tmp) -> list[dict]:
    import csv
    return list(csv.DictReader((tmp / "s.csv").open()))


def _priced_the_recommended(out, err, tmp) -> str | None:
    """Each row prices its max micro-batch: priced_micro_batch = max_micro_batch, tokens = it x seq_len (64)."""
    for r in _csv_rows(out, err, tmp):
        if r["priced_micro_batch"] != r["max_micro_batch"] or int(r["tokens_per_step"]) != 64 * int(
                r["max_micro_batch"]):
            return (f"micro_batch {r['micro_batch']}: priced {r['priced_micro_batch']} ({r['tokens_per_step']} "
                    f"tokens) where {r['max_micro_batch']} is recommended")
    return None


def _finite_cells(out, err, tmp) -> str | None:
    bad = [c for r in _csv_rows(out, err, tmp) for c in r.values() if c.lower() in ("inf", "-inf", "nan")]
    return f"non-finite cells: {bad}" if bad else None


MIXED = ("import torch\n\n\ndef factory(micro_batch: int = 2):\n"
         "    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))\n"
         "    return model, torch.randn(micro_batch, 8), lambda out: out.sum()\n")
SIM = ("simulate", "--preset", "tiny", "--steps", "1")
TINY_SWEEP = ("sweep", "--preset", "tiny", "--device", "cpu")
SWEEP_KILLED = (*TINY_SWEEP, "--jobs", "2", "--grid", "micro_batch=" + ",".join(map(str, range(1, 21))),
                "--grid", "seq_len=" + ",".join(map(str, range(2, 62, 2))), "--output", "{tmp}/s.csv")
RAY = (*TINY_SWEEP, "--engine", "ray", "--grid", "micro_batch=1,2", "--output", "{tmp}/s.csv")
DASK = (*TINY_SWEEP, "--engine", "dask", "--grid", "micro_batch=1,2", "--output", "{tmp}/s.csv")
H100_SWEEP = ("sweep", "--preset", "tiny", "--device", "H100-80GB", "--grid", "micro_batch=1,2")
CAL = ("calibrate", "apply", "--preset", "tiny", "--device", "cpu", "--seq-len", "24", "--calibration", "{tmp}/c.json")

CASES_34: list[Case] = [
    # --- code from data -----------------------------------------------------------------------------------
    Case("csv-module-column", "code from data", "a calibrate fit --csv row's module=<file>.py:factory was imported "
         "and its factory run", ("calibrate", "fit", "--csv", "{tmp}/m.csv", "--output", "{tmp}/c.json"),
         {"m.csv": _module_csv}, says=("never names code", "--module"), check=_evil_did_not_run),
    Case("csv-scenario-column", "code from data", "a calibrate CSV's scenario column was read as a path",
         ("calibrate", "fit", "--csv", "{tmp}/m.csv", "--output", "{tmp}/c.json"),
         {"m.csv": _text("scenario,seq_len,measured_allocated\n/etc/passwd,16,1MiB\n/etc/passwd,32,2MiB\n")},
         says=("never names code", "--scenario")),
    Case("csv-hf-config-column", "code from data", "a calibrate CSV's hf_config column was read as a path",
         ("calibrate", "fit", "--csv", "{tmp}/m.csv", "--output", "{tmp}/c.json"),
         {"m.csv": _text("hf_config,seq_len,measured_allocated\n/etc/passwd,16,1MiB\n/etc/passwd,32,2MiB\n")},
         says=("never names code", "--hf-config")),
    # --- the fit check ------------------------------------------------------------------------------------
    Case("check-stop-at-oom-cpu", "fit check", "--check --stop-at-oom said FITS from the peak before the failed "
         "allocation (exit 0)", (*SIM, "--device", "cpu", "--budget", "1MiB", "--check", "--stop-at-oom"),
         code=1, says=("does not fit", "at least")),
    Case("check-stop-at-oom-gpu", "fit check", "--check --stop-at-oom on a GPU profile said FITS with a negative "
         "margin", ("simulate", "--preset", "gpt2", "--budget", "7GiB", "--check", "--stop-at-oom"),
         code=1, says=("does not fit", "at least")),
    Case("check-closed-pipe", "fit check", "--check | true (pipefail): a closed stdout was exit 0 for a run that does "
         "not fit", (*SIM, "--device", "cpu", "--budget", "1MiB", "--check"), code=1, driver=closed_stdout),
    Case("check-closed-pipe-json", "fit check", "--check --json into a closed pipe: exit 0 for a run that does not "
         "fit", (*SIM, "--device", "cpu", "--budget", "1MiB", "--check", "--json"), code=1, driver=closed_stdout),
    Case("max-batch-closed-pipe", "fit check", "max-batch --check into a closed pipe: exit 0 when none fits",
         ("max-batch", "--preset", "gpt2", "--budget", "1GiB", "--check"), code=1, driver=closed_stdout),
    Case("check-closed-pipe-fits", "fit check", "--check into a closed pipe for a run that fits: exit 0, no traceback",
         (*SIM, "--device", "cpu", "--budget", "1GiB", "--check"), code=0, driver=closed_stdout),
    # --- output faults ------------------------------------------------------------------------------------
    Case("out-symlink-loop", "output faults", "an output path that is a symlink loop: exit 3 after the run",
         (*SIM, "--plot", "{tmp}/loop1"), says=("--plot", "symbolic links")),
    Case("out-full-sweep-csv-png", "output faults", "sweep --output s.csv --plot p.png on a full disk left s.csv "
         "(exit 3)", ("sweep", "--preset", "tiny", "--device", "cpu", "--grid", "micro_batch=1,2", "--output",
                      "{tmp}/s.csv", "--plot", "{tmp}/p.png"),
         says=("--plot", "nothing was written"), check=_nothing_left("s.csv", "p.png"),
         driver=file_size_limit(16 << 10)),
    Case("out-full-simulate-exports", "output faults", "simulate with several exports on a full disk left p.png",
         (*SIM, "--plot", "{tmp}/p.png", "--export-snapshot", "{tmp}/s.pickle", "--export-chrome", "{tmp}/c.json"),
         says=("nothing was written",), check=_nothing_left("p.png", "s.pickle", "c.json"),
         driver=file_size_limit(16 << 10)),
    # --- sweeps under faults -------------------------------------------------------------------------------
    Case("sweep-killed-worker", "sweep faults", "sweep --engine local: one pool worker SIGKILLed mid-sweep, and the "
         "sweep waited for the lost chunk for ever", SWEEP_KILLED, code=0, check=_same_rows_as_undisturbed,
         driver=killed_worker(after_s=0.3)),
    Case("sweep-poison-point", "sweep faults", "a point that kills its worker every time (the OOM killer) hung the "
         "sweep", (*TINY_SWEEP, "--jobs", "2", "--grid", "micro_batch=1,2,3,4", "--output", "{tmp}/s.csv"),
         says=("micro_batch=3", "killed its worker process twice"), check=_nothing_left("s.csv"), driver=poisoned),
    # --- cluster addresses --------------------------------------------------------------------------------
    Case("ray-closed-port", "cluster addresses", "ray --address 127.0.0.1:1 hung past 90 s, ignoring SIGTERM",
         (*RAY, "--address", "127.0.0.1:1"), says=("address", "127.0.0.1:1")),
    Case("ray-auto-no-cluster", "cluster addresses", "ray --address auto with no cluster running: exit 3",
         (*RAY, "--address", "auto"), says=("address", "no ray cluster"), driver=no_ray_cluster),
    Case("ray-malformed", "cluster addresses", "a malformed ray:// address: exit 3", (*RAY, "--address", "ray://:x"),
         says=("address", "ray://:x")),
    Case("ray-silent-peer", "cluster addresses", "a ray address where a server accepts and never answers",
         (*RAY, "--address", "127.0.0.1:{port}"), says=("address",), driver=silent_peer),
    Case("dask-silent-peer", "cluster addresses", "a dask address where a server accepts and never answers (an HTTP "
         "server) hung past 90 s", (*DASK, "--address", "tcp://127.0.0.1:{port}"), says=("address", "sent nothing"),
         driver=silent_peer),
    Case("dask-malformed", "cluster addresses", "a malformed dask address: exit 2 after 41 s with a traceback",
         (*DASK, "--address", "http://127.0.0.1:8786"), says=("address", "http://")),
    # --- unbounded work -----------------------------------------------------------------------------------
    Case("sweep-1e8-points", "unbounded work", "a grid of 10^8 points grew to 3.7 GB and died with MemoryError",
         (*TINY_SWEEP, *(x for f in ("micro_batch", "seq_len", "n_layer", "grad_accum") for x in (
             "--grid", f"{f}=" + ",".join(map(str, range(1, 101))))), "--output", "{tmp}/s.csv"),
         says=("100,000,000 points", "--max-points")),
    Case("sweep-40k-points", "unbounded work", "40,000 tiny points ran past 90 s at 2.2 GB with no estimate or "
         "refusal", (*TINY_SWEEP, "--grid", "micro_batch=" + ",".join(map(str, range(1, 201))), "--grid",
                     "seq_len=" + ",".join(map(str, range(1, 201))), "--output", "{tmp}/s.csv"),
         says=("40,000 points", "--max-points")),
    Case("sweep-over-time-limit", "unbounded work", "a sweep had no bound on its wall time (here: 1 s)",
         ("sweep", "--preset", "llama-3-70b", "--grid", "micro_batch=" + ",".join(map(str, range(1, 41))), "--grid",
          "seq_len=2048,4096,8192", "--time-limit", "1s", "--output", "{tmp}/s.csv"),
         says=("time_limit", "nothing written"), check=_nothing_left("s.csv")),
    # --- deadline prices ----------------------------------------------------------------------------------
    Case("deadline-cpu-no-budget", "deadline prices", "on --device cpu with no budget every point 'fit' an invented "
         "24 GiB", (*TINY_SWEEP, "--grid", "micro_batch=1,2", "--target-tokens", "1e6", "--deadline", "1h",
                    "--output", "{tmp}/s.csv"), says=("budget",), check=_nothing_left("s.csv")),
    Case("deadline-max-batch-price", "deadline prices", "with --max-batch the GPU-hours priced the grid's "
         "micro-batch, not the one recommended", (*H100_SWEEP, "--budget", "1GiB", "--max-batch", "--target-tokens",
                                                  "1e9", "--deadline", "1h", "--output", "{tmp}/s.csv"),
         code=0, check=_priced_the_recommended),
    Case("deadline-forward-passes", "deadline prices", "--passes forward was priced as training steps",
         (*H100_SWEEP, "--passes", "forward", "--target-steps", "1000", "--deadline", "1h", "--output",
          "{tmp}/s.csv"), says=("passes",)),
    Case("deadline-inf", "deadline prices", "inf reached the CSV and the ranking (--step-time 1e300d)",
         (*H100_SWEEP, "--target-tokens", "1e21", "--deadline", "1h", "--step-time", "1e300d", "--output",
          "{tmp}/s.csv"), says=("step_time", "too large")),
    Case("deadline-largest-finite", "deadline prices", "the largest step time taken gives finite columns",
         (*H100_SWEEP, "--target-tokens", "1e21", "--deadline", "1h", "--step-time", "36525d", "--output",
          "{tmp}/s.csv"), code=0, check=_finite_cells),
    Case("deadline-underflow", "deadline prices", "--deadline 1e-400s was refused as 'must be > 0'",
         (*H100_SWEEP, "--target-tokens", "1e6", "--deadline", "1e-400s", "--output", "{tmp}/s.csv"),
         says=("too small",)),
    # --- readers ------------------------------------------------------------------------------------------
    Case("calibration-residual-1e308", "readers", "a calibration file with a residual of 1e308: OverflowError, exit 3",
         CAL, {"c.json": _calibration(_residual_huge)}, says=("calibration", "residual")),
    Case("calibration-nested", "readers", "a calibration file nested 100,000 deep: RecursionError, exit 3", CAL,
         {"c.json": _nested(100_000)}, says=("calibration", "nested too deeply")),
    Case("ledger-rank-superscript", "readers", "ledger: a rank cell '²' (a digit to isdigit, not to int): exit 3",
         ("ledger", "{tmp}/e.csv"), {"e.csv": _text(LEDGER_HEADER + "0,a,1MiB,alloc,²\n")}, says=("rank",)),
    Case("ledger-rank-thai-digit", "readers", "ledger: a Thai digit three read as rank 3",
         ("ledger", "{tmp}/e.csv"), {"e.csv": _text(LEDGER_HEADER + "0,a,1MiB,alloc,๓\n")}, says=("rank",)),
    Case("ledger-time-thai-digit", "readers", "ledger: a Thai digit read as the time 3",
         ("ledger", "{tmp}/e.csv"), {"e.csv": _text(LEDGER_HEADER + "๓,a,1MiB,alloc,0\n")}, says=("time",)),
    Case("ledger-megabit", "readers", "ledger: 1Mb (megabit) read as 1,000,000 B",
         ("ledger", "{tmp}/e.csv"), {"e.csv": _text(LEDGER_HEADER + "0,a,1Mb,alloc,0\n")}, says=("ambiguous",)),
    Case("budget-gigabit", "readers", "--budget 24gb read as 24 GB", (*SIM, "--budget", "24gb"),
         says=("ambiguous",)),
    Case("ledger-duplicate-key", "readers", "ledger JSON: a key given twice kept its last value",
         ("ledger", "{tmp}/e.json"),
         {"e.json": _text('[{"time": 0, "object": "a", "bytes": 1024, "bytes": 1, "action": "alloc"}]')},
         says=("given twice",)),
    Case("hf-duplicate-key", "readers", "an HF config.json with a key given twice kept its last value",
         ("simulate", "--hf-config", "{tmp}/config.json", "--steps", "1"),
         {"config.json": lambda: _hf()()[:-1] + b', "n_layer": 200}'}, says=("given twice",)),
    Case("hf-vocab-zero", "readers", "an HF config with vocab_size 0: exit 3",
         ("simulate", "--hf-config", "{tmp}/config.json", "--steps", "1"), {"config.json": _hf(vocab_size=0)},
         says=("vocab_size", "positive")),
    Case("hf-number-overflow", "readers", "an HF config number 1e999 (read as inf)",
         ("simulate", "--hf-config", "{tmp}/config.json", "--steps", "1"),
         {"config.json": lambda: _hf()()[:-1] + b', "layer_norm_epsilon": 1e999}'}, says=("out of range",)),
    Case("fifo-trickle", "readers", "a named pipe whose writer sends a line every 5 s held the reader without end",
         ("ledger", "{tmp}/fifo"), says=("still sending",), driver=fifo_trickle(5.0)),
    # --- user code -----------------------------------------------------------------------------------------
    Case("factory-mixed-dtype-compile", "user code", "a float32 batch into parameters --precision bf16 makes bf16, "
         "under --compile: the GEMM probe's real call failed, exit 3 (internal error)",
         ("simulate", "--module", "{tmp}/f.py:factory", "--device", "cpu", "--steps", "1", "--precision", "bf16",
          "--compile"), {"f.py": _text(MIXED)}, says=("aten.addmm", "same dtype")),
    # --- flags --------------------------------------------------------------------------------------------
    Case("flag-twice", "flags", "a flag given twice was taken silently (last wins: --budget 1GiB --budget 1MiB)",
         (*SIM, "--budget", "1GiB", "--budget", "1MiB"), says=("--budget is given twice",)),
    Case("flag-twice-switch", "flags", "a switch given twice (--json --json) was taken silently",
         (*SIM, "--json", "--json"), says=("--json is given twice",)),
    Case("flag-thai-digit", "flags", "--micro-batch ๓ (a Thai digit) read as 3", (*SIM, "--micro-batch", "๓"),
         says=("invalid int value",)),
    Case("case-thai-digit", "flags", "compare --case 'a: micro_batch=๓' read as 3",
         ("compare", "--preset", "tiny", "--steps", "1", "--case", "a: micro_batch=๓"), says=("micro_batch",)),
]
CASES_34 += USER_CODE_CASES  # (bench/hardening_user_code.py)

__all__ = ["CASES_34", "closed_stdout", "file_size_limit", "fifo_trickle", "silent_peer"]
