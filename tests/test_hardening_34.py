"""Issue 34's findings, each recreated (bench/hardening_cases_34.py): exit 2 with one line naming the input, the
verdict's exit 1, or the right outcome; never a traceback. A case without a driver runs in process; one with a
driver (a closed stdout, a file-size limit, a killed worker, a silent peer) runs as a real command, as
bench/hardening.py runs every case."""

from __future__ import annotations

import sys

import pytest
from hardening import run_case as run_command
from hardening_cases import REPO, assert_outcome, make_special_files
from hardening_cases_34 import CASES_34

from peakledger import cli
from peakledger.simulator import safe_io

IN_PROCESS = [c for c in CASES_34 if c.driver is None]
# (the trickling pipe's real command takes its 30 s: test_a_pipe_read_past_its_total_time_is_refused runs it here)
AS_COMMANDS = [c for c in CASES_34 if c.driver is not None and c.id != "fifo-trickle"]


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.id for c in IN_PROCESS])
def test_case(case, tmp_path, capsys):
    for name, make in case.files.items():
        (tmp_path / name).write_bytes(make())
    make_special_files(case, tmp_path)
    code = cli.main([a.format(tmp=tmp_path, repo=REPO) for a in case.argv])
    out, err = capsys.readouterr()
    assert_outcome(case, code, out, err, tmp_path)


@pytest.mark.parametrize("case", AS_COMMANDS, ids=[c.id for c in AS_COMMANDS])
def test_case_as_a_command(case, monkeypatch):
    right, outcome = run_command(case, sys.executable, timeout=90.0, memory=16 << 30)
    assert right, outcome


def test_a_pipe_read_past_its_total_time_is_refused(tmp_path, monkeypatch, capsys):
    """The total limit of a trickling pipe, in process (its real-command case takes 30 s)."""
    import os
    import threading
    import time

    monkeypatch.setattr(safe_io, "PIPE_TOTAL_SECONDS", 1.0)
    os.mkfifo(tmp_path / "fifo")

    def feed():
        try:
            with open(tmp_path / "fifo", "w") as f:
                f.write("time,object,bytes,action\n")
                for i in range(40):
                    f.write(f"{i},x{i},1KiB,alloc\n")
                    f.flush()
                    time.sleep(0.1)
        except OSError:  # (the reader has closed it)
            pass
    threading.Thread(target=feed, daemon=True).start()
    assert cli.main(["ledger", str(tmp_path / "fifo")]) == 2
    assert "still sending after 1 s" in capsys.readouterr().err


def test_outputs_are_all_or_none_when_a_write_fails(tmp_path, monkeypatch, capsys):
    """The second of two outputs fails (a full disk): neither is left, and the error names the output."""
    import errno
    real = safe_io.os.fdopen
    calls = []

    def fdopen(fd, *a, **k):
        f = real(fd, *a, **k)
        calls.append(fd)
        if len(calls) == 2:
            def full(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = full
        return f

    monkeypatch.setattr(safe_io.os, "fdopen", fdopen)
    code = cli.main(["sweep", "--preset", "tiny", "--device", "cpu", "--grid", "micro_batch=1,2", "--jobs", "1",
                     "--output", str(tmp_path / "s.csv"), "--json-output", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert code == 2 and "--json-output: cannot write" in err and "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
