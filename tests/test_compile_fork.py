"""models/compile/fork.py: a compile forked beside this process's; one that dies or stalls gives None (the caller
compiles that depth itself) instead of an error or a wait without end."""

from __future__ import annotations

import sys
import time

import pytest

from peakledger.models.compile import fork
from peakledger.models.config import TrainingSetup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork is taken on Linux only")


def _stuck(model, setup):
    time.sleep(600)  # alive, no CPU: as a child waiting on a lock no thread of it will release


def _fails(model, setup):
    raise RuntimeError("a compile that fails")


def test_a_stalled_child_is_killed_and_gives_none(monkeypatch):
    monkeypatch.setattr(fork, "STALL_S", 1.0)
    start = time.monotonic()
    assert fork.forked_compile(_stuck, None, TrainingSetup())() is None
    assert time.monotonic() - start < 60


def test_a_failed_child_gives_none():
    assert fork.forked_compile(_fails, None, TrainingSetup())() is None
