"""models/forked.py and models/compile/fork.py: work forked beside this process's; a child that dies or stalls gives
None (the caller does that work itself) instead of an error or a wait without end; one that succeeds, its result."""

from __future__ import annotations

import sys
import time

import pytest

from peakledger.models import forked
from peakledger.models.compile import fork
from peakledger.models.config import TrainingSetup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork is taken on Linux only")


def _stuck(model, setup):
    time.sleep(600)  # alive, no CPU: as a child waiting on a lock no thread of it will release


def _fails(model, setup):
    raise RuntimeError("a compile that fails")


def test_a_stalled_child_is_killed_and_gives_none(monkeypatch):
    monkeypatch.setattr(forked, "STALL_S", 1.0)
    monkeypatch.setattr(forked, "worth_forking", lambda: True)
    start = time.monotonic()
    assert fork.forked_compile(_stuck, None, TrainingSetup())() is None
    assert time.monotonic() - start < 60


def test_a_failed_child_gives_none(monkeypatch):
    monkeypatch.setattr(forked, "worth_forking", lambda: True)
    assert fork.forked_compile(_fails, None, TrainingSetup())() is None


def test_a_childs_result_comes_back_and_none_where_forking_is_off(monkeypatch):
    monkeypatch.setattr(forked, "worth_forking", lambda: True)
    assert forked.forked(lambda: {"pid": __import__("os").getpid(), "x": [1, 2]})()["x"] == [1, 2]
    assert forked.forked(lambda: __import__("os").getpid())() != __import__("os").getpid()  # another process
    monkeypatch.undo()
    monkeypatch.setenv(forked.ENV, "0")
    assert not forked.worth_forking() and forked.forked(lambda: 1)() is None
