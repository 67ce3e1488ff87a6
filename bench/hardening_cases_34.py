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


def _finish(p: subprocess.Popen, timeout: float, stdout: str = "") -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, stdout + (out or ""), err)


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


def silent_peer(cmd, tmp, timeout, preexec) -> subprocess.CompletedProcess:
    """{port}: a TCP server on 127.0.0.1 that accepts every connection and never sends a byte (an HTTP server
    waiting for a request; a firewall's tarpit)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
    threading.Thread(target=accept, daemon=True).start()
    port = server.getsockname()[1]
    try:
        p = _popen([a.replace("{port}", str(port)) for a in cmd], tmp, preexec, stdout=subprocess.PIPE)
        return _finish(p, timeout)
    finally:
        stop.set()
        for c in held:
            c.close()
        server.close()


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


SIM = ("simulate", "--preset", "tiny", "--steps", "1")
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
