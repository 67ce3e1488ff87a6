"""models/forked.py `shared_map`: the plain loop's results, in order, whichever process did each item; what the child
could not do is done here; an exception is the plain loop's."""

from __future__ import annotations

import os
import time

import pytest

from peakledger.models import forked
from peakledger.models.forked import shared_map

pytestmark = pytest.mark.skipif(not forked.worth_forking(), reason="needs a fork and two usable cores")


def test_results_are_the_loops_in_order_and_both_processes_take_items():
    parent = os.getpid()
    out = shared_map(lambda x: (time.sleep(0.05), x * x, os.getpid())[1:], range(40))  # (the child starts later)
    assert [v for v, _ in out] == [x * x for x in range(40)]
    assert {pid for _, pid in out} - {parent}, "no item was done in the child"


def test_done_is_called_once_per_item_here():
    seen = []
    shared_map(lambda x: x * 2, list("abcdefgh"), lambda i, item: seen.append((i, item, os.getpid())))
    assert sorted((i, item) for i, item, _ in seen) == list(enumerate("abcdefgh"))
    assert {pid for _, _, pid in seen} == {os.getpid()}


def test_an_item_that_raises_in_the_child_is_done_again_here():
    parent = os.getpid()
    out = shared_map(lambda x: (x, os.getpid()) if os.getpid() == parent or x % 2 else 1 // 0, range(20))
    assert [v for v, _ in out] == list(range(20))
    assert all(pid == parent for v, pid in out if v % 2 == 0)


def test_a_child_that_dies_leaves_its_items_to_this_process():
    parent = os.getpid()
    out = shared_map(lambda x: x if os.getpid() == parent else os._exit(3), range(10))
    assert out == list(range(10))


def test_an_exception_here_is_raised_as_the_loop_raises_it():
    with pytest.raises(ZeroDivisionError):
        shared_map(lambda x: 1 // (x - 5), range(10))


def test_one_core_or_fork_off_is_the_plain_loop(monkeypatch):
    monkeypatch.setenv(forked.ENV, "0")
    parent = os.getpid()
    assert shared_map(lambda x: (x, os.getpid()), range(5)) == [(x, parent) for x in range(5)]


def test_a_shared_map_inside_one_is_a_plain_loop():
    # (its items done where the outer item runs: no third process on two cores, no fork of a forked child)
    def outer(x):
        time.sleep(0.05)  # (the child starts later)
        return os.getpid(), shared_map(lambda y: (x + y, os.getpid()), range(6))

    out = shared_map(outer, range(20))
    assert [[v for v, _ in inner] for _, inner in out] == [[x + y for y in range(6)] for x in range(20)]
    assert all({pid for _, pid in inner} == {outer} for outer, inner in out)
    assert len({outer for outer, _ in out}) == 2 and not forked._SHARING[0]  # (both processes took items)
