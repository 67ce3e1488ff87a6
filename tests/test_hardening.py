"""Issue 11's findings, each recreated (bench/hardening_cases.py): exit 2 with a message naming the input,
or the right number; never a traceback. Plus: every real snapshot of ../shared/gpu-truth through explain and
validate, a malicious pickle refused before it runs, and an internal error said as one (exit 3)."""

from __future__ import annotations

import os

import pytest
from hardening_cases import CASES, EVIL_PICKLE, GPU_TRUTH, REPO, assert_outcome, make_special_files

from peakledger import api, cli
from peakledger.simulator import safe_io


def run_case(case, tmp_path, capsys):
    for name, make in case.files.items():
        (tmp_path / name).write_bytes(make())
    make_special_files(case, tmp_path)
    argv = [a.format(tmp=tmp_path, repo=REPO, gpu=GPU_TRUTH) for a in case.argv]
    old = os.umask(case.umask) if case.umask is not None else None
    try:
        code = cli.main(argv)
    finally:
        if old is not None:
            os.umask(old)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case, tmp_path, capsys, monkeypatch):
    if "{gpu}" in " ".join(case.argv) and not GPU_TRUTH.is_dir():
        pytest.skip("../shared/gpu-truth is not beside this checkout")
    monkeypatch.setattr(safe_io, "PIPE_IDLE_SECONDS", 0.5)  # (a pipe nothing writes to: refused sooner here)
    code, out, err = run_case(case, tmp_path, capsys)
    assert_outcome(case, code, out, err, tmp_path)


@pytest.mark.skipif(not GPU_TRUTH.is_dir(), reason="../shared/gpu-truth is not beside this checkout")
@pytest.mark.parametrize("snapshot", sorted(p.name for p in GPU_TRUTH.glob("*.pickle")) if GPU_TRUTH.is_dir() else [])
def test_every_gpu_truth_snapshot_reads_without_a_traceback(snapshot, capsys):
    path = str(GPU_TRUTH / snapshot)
    assert cli.main(["explain", "--trace", path, "--budget", "40GiB"]) == 0
    out, err = capsys.readouterr()
    assert "CUDA snapshot" in out and not err
    assert cli.main(["validate", "--trace", path]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("peakledger: error: trace: ") and err.count("\n") == 1


def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, capsys):
    marker = "/tmp/peakledger-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    (tmp_path / "evil.pickle").write_bytes(EVIL_PICKLE)
    assert b"system" in EVIL_PICKLE
    assert cli.main(["explain", "--trace", str(tmp_path / "evil.pickle"), "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "refusing to load" in err and "system" in err
    assert not os.path.exists(marker)


def test_an_internal_error_is_one_line_and_exit_3(monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "run", broken)
    assert cli.main(["simulate", "--preset", "tiny"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" in err and "--debug" in err and "Traceback" not in err
    assert cli.main(["simulate", "--preset", "tiny", "--debug"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: boom" in err


def test_a_temporary_file_is_removed_when_the_write_fails(tmp_path, monkeypatch):
    from peakledger.simulator import safe_io

    def failing_replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(safe_io.os, "replace", failing_replace)
    with pytest.raises(KeyboardInterrupt):
        safe_io.write_atomic(tmp_path / "out.json", b"data")
    assert os.listdir(tmp_path) == []


def test_a_read_only_output_is_not_replaced(tmp_path, monkeypatch, capsys):
    # the atomic rename would replace a 0444 file its owner could not write with open(); as root (this machine's
    # CI) open() may write it, so the check asks os.access as a non-root user would be answered
    target = tmp_path / "c.json"
    target.write_text("keep")
    target.chmod(0o444)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: False if str(p) == str(target) and m == os.W_OK
                        else real_access(p, m, **kw))
    assert cli.main(["simulate", "--preset", "tiny", "--steps", "1", "--export-chrome", str(target)]) == 2
    assert "read-only" in capsys.readouterr().err and target.read_text() == "keep"


def test_real_memory_taken_by_user_code_is_measured_and_named():
    # a factory runs under the fake mode: real memory it takes (a numpy array, torch.from_numpy) is refused
    import numpy

    from peakledger.models.config import ConfigError
    from peakledger.models.traced.boundary import user_code
    with pytest.raises(ConfigError, match=r"factory\(\) took .* GiB of real memory"):
        with user_code("factory()", real_bytes=64 << 20):
            big = numpy.ones((512 << 20) // 8)  # written: resident
    with user_code("factory()", real_bytes=64 << 20):
        small = numpy.ones(1024)
    assert big.size and small.size
