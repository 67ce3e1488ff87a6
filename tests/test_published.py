"""The scoreboard of published measurements (bench/published_cases.py, bench/published.py): its data is well formed
(every case cites a repository, a file and a commit or thread, measures one of the allowed kinds, states its
setup, and a pending case carries the knob values it will run with), and the summary statistics are computed right
on a hand-made list. The predictions themselves are the scoreboard (bench/VALIDATION.md), not asserted here."""

from __future__ import annotations

import re

import pytest
from published import Row, pending_state, section, summarize
from published import main as published_main
from published_cases import CASES, MEASURES, MOMENTS, UNITS, Case, Source

from peakledger.scenario import build_scenario

REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
THREAD = re.compile(r"^https://github\.com/[^/]+/[^/]+/(pull|issues)/\d+$")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_is_well_formed(case: Case):
    src = case.source
    assert REPO.match(src.repo), src.repo
    assert src.path.strip()
    assert COMMIT.match(src.commit) or THREAD.match(src.issue), (src.commit, src.issue)
    assert case.measures in MEASURES
    assert case.unit in UNITS
    assert case.moment in MOMENTS
    assert len(case.setup) > 40 and case.measured_by.strip()
    assert case.figure > 0
    assert case.model and case.training and case.device
    for item in case.unstated:  # "what -> the value taken (from where)"
        assert "->" in item, item


def test_case_names_are_unique_and_there_are_ten_modelled():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert sum(c.modelled for c in CASES) >= 10


@pytest.mark.parametrize("case", [c for c in CASES if c.pending], ids=lambda c: c.name)
def test_pending_case_carries_the_knobs_it_will_run_with(case: Case):
    for item in case.pending:
        technique, knobs = item.rsplit(": ", 1)
        assert technique.strip()
        for pair in knobs.split(", "):
            knob, value = pair.split("=", 1)
            assert str(case.training[knob]) == value, (knob, case.training.get(knob), value)


@pytest.mark.parametrize("case", [c for c in CASES if c.modelled], ids=lambda c: c.name)
def test_modelled_case_builds_its_scenario(case: Case):
    scenario = build_scenario(dict(case.model), dict(case.training), {"device": case.device}, name=case.name)
    assert scenario.device == case.device


def test_published_bytes_reads_the_unit_as_printed():
    src = Source("a/b", "README.md", "0" * 40)
    gib = Case("x", src, "s" * 50, "reserved", "max_memory_reserved", 1.5, "GiB", {"preset": "tiny"}, {"seq_len": 8},
               "cpu")
    assert gib.published_bytes == 1.5 * 2**30
    gb = Case("y", src, "s" * 50, "reserved", "max_memory_reserved", 1.5, "GB", {"preset": "tiny"}, {"seq_len": 8},
              "cpu", pending=("t: k=v",))
    assert gb.published_bytes == 1.5e9 and not gb.modelled and gb.fully_stated


def test_summary_statistics_on_a_hand_made_list():
    rows = [
        Row("a", 100.0, 110.0),  # +10%
        Row("b", 200.0, 150.0, fully_stated=False),  # -25%: the worst
        Row("c", 50.0, 49.0),  # -2%
        Row("d", 80.0, None),  # pending
        Row("e", 1000.0, 1040.0, fully_stated=False),  # +4%
    ]
    assert rows[3].error is None
    assert rows[1].error == pytest.approx(-0.25)
    s = summarize(rows)
    assert (s.cases, s.modelled, s.pending) == (5, 4, 1)
    assert s.median_abs_error == pytest.approx((0.04 + 0.10) / 2)  # |errors| 0.02, 0.04, 0.10, 0.25
    assert s.worst_abs_error == pytest.approx(0.25) and s.worst == "b"
    assert s.under_predicted == 2  # b and c
    assert s.not_fully_stated == 2  # b and e
    odd = summarize(rows[:3])
    assert odd.median_abs_error == pytest.approx(0.10)


def test_summary_of_nothing_modelled():
    s = summarize([Row("d", 80.0, None)])
    assert (s.modelled, s.pending, s.median_abs_error, s.worst, s.under_predicted) == (0, 1, None, "", 0)


def test_section_lists_every_case_with_its_setup():
    case = next(c for c in CASES if c.pending and c.unstated)
    text = section([(case, Row(case.name, case.published_bytes, None, case.fully_stated), 0.0)], "cmd")
    assert text.startswith("## Published measurements (scoreboard)\n")
    assert f"| {case.name} |" in text and "| pending |" in text
    assert case.setup in text and "setup not fully stated:" in text and "technique not yet modelled:" in text


def test_unknown_case_name_is_one_line_exit_2(capsys):
    assert published_main(["--only", "no-such-case"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no-such-case" in err and "allowed:" in err


def test_pending_state_says_whether_the_knobs_build_yet():
    src = Source("a/b", "README.md", "0" * 40)
    ready = Case("r", src, "s" * 50, "allocated", "max_memory_allocated", 1.0, "GB", {"preset": "tiny"},
                 {"seq_len": 8}, "cpu", pending=("t: seq_len=8",))
    assert pending_state(ready) == "knobs build"
    waiting = Case("w", src, "s" * 50, "allocated", "max_memory_allocated", 1.0, "GB", {"preset": "tiny"},
                   {"seq_len": 8, "no_such_knob_yet": 1}, "cpu", pending=("t: no_such_knob_yet=1",))
    state = pending_state(waiting)
    assert state.startswith("not yet: no_such_knob_yet") and "allowed" not in state
