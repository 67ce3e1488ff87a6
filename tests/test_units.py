"""Units people can act on (issue 37): every table the CLI prints in one unit, named in its head, each cell a number
in it equal to the API's bytes converted (tests/tables.py reads them back); durations in ms / s / min / h with three
significant digits and never scientific notation; the sweep's CSV with units in its column names and rounded
seconds and hours. Expected numbers come from the API, converted here."""

from __future__ import annotations

import csv
import io
import re

import pytest
from tables import UNIT_BYTES, cell_equals, decimals, is_number

from peakledger import api
from peakledger.analysis.checkpointing import policy_table
from peakledger.analysis.units import Scale, format_duration
from peakledger.cli import main
from peakledger.deadline import DeadlineBudget
from peakledger.scenario import build_scenario
from peakledger.sweep import run_sweep, to_csv, to_json

TINY = ["--preset", "tiny", "--micro-batch", "2", "--seq-len", "16"]
WITH_UNIT = re.compile(r"[0-9] ?(B|KiB|MiB|GiB|TiB|KB|MB|GB)\b")


def tiny(**run):
    return build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16}, run)


def printed(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def section(text: str, head: str) -> list[str]:
    """The lines of the table whose title line starts with `head`, the title first, up to the blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def unit_of(title: str) -> str:
    """'ledger at the peak (MiB; ...)' -> 'MiB'."""
    return re.search(r"\((B|KiB|MiB|GiB|TiB|KB|MB|GB)[;)]", title).group(1)


# -- durations -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds, text", [
    (0.0004, "0.400 ms"), (0.85, "850 ms"), (51.04, "51.0 s"), (5104, "1.42 h"), (51040, "14.2 h"),
    (0.9996, "1.00 s"),  # rounds up into the next unit, not '1000 ms'
    (754.2, "12.6 min"), (3599.9, "1.00 h"), (5.104e4 * 1e-3, "51.0 s"), (0, "0 s"), (1e-9, "<0.001 ms"),
    (-0.85, "-850 ms"), (3.6e9, "1,000,000 h"),
])
def test_format_duration_reads_as_people_read(seconds, text):
    assert format_duration(seconds) == text
    assert "e" not in format_duration(seconds).replace("ms", "").replace(" h", "").replace("min", "")


# -- a table in one unit ---------------------------------------------------------------------------------------

def test_a_scale_picks_one_unit_and_decimals_from_the_largest_value():
    g = Scale.of([3_053_453_312, 8192, 592, 0])  # 2.844 GiB, 8 KiB, 592 B, 0
    assert (g.unit, g.decimals) == ("GiB", 3)
    assert [g.number(n) for n in (3_053_453_312, 8192, 592, 0, -8192)] == ["2.844", "<0.001", "<0.001", "0.000",
                                                                           ">-0.001"]
    assert Scale.of([600 << 20]).unit == "MiB" and Scale.of([592]).unit == "B" and Scale.of([]).unit == "B"
    assert Scale.of([600 << 20], "GiB").number(600 << 20) == "0.5859"  # a unit asked for: 4 significant digits
    assert Scale.of([5e-3, 19.38], kind="seconds").unit == "s" and Scale.of([0.0051], kind="seconds").unit == "ms"


def test_simulate_tables_one_unit_each_equal_to_the_api(capsys):
    report = api.run(tiny(device="H100-80GB"))
    text = printed(capsys, "simulate", *TINY)
    ledger = section(text, "ledger at the peak (")
    unit = unit_of(ledger[0])
    assert unit == "MiB"  # no --unit: the unit of the table's largest value (the total, ~67 MiB)
    rows = {line.split()[0]: line for line in ledger[2:]}
    for row in report.ledger:  # 'at peak' and 'row max': numbers in the head's unit, the API's bytes
        line = rows[row.row]
        assert cell_equals(line[32:46].strip(), row.bytes, unit) and cell_equals(line[-14:].strip(), row.max_bytes,
                                                                                  unit), line
    assert cell_equals(rows["total"].split()[1], sum(r.bytes for r in report.ledger), unit)
    assert "<0.01" in rows["input"]  # a value too small for the table's decimals: said so, in the table's unit
    phases = section(text, "peak by phase (")
    unit = unit_of(phases[0])
    for p, line in zip(report.phases, phases[2:], strict=True):
        cells = [line[30:44].strip(), line[44:58].strip(), line[58:72].strip()]
        assert all(cell_equals(c, b, unit) for c, b in zip(cells, (p.allocated, p.reserved, p.device_total))), line
        assert len({decimals(c) for c in cells}) == 1
    for table in (ledger, phases):  # no cell carries a unit of its own
        assert not [line for line in table[2:] if WITH_UNIT.search(line)]
    block = {m.group(1): (m.group(2), m.group(3)) for line in section(text, "true peak")
             if (m := re.match(r"^(true|first-step|steady|host) peak\s+(\S+) (\w+)  at", line))}
    assert {u for _, u in block.values()} == {"MiB"}  # the peaks: one unit for the block, the host's 592 B too
    assert cell_equals(block["true"][0], report.peaks.overall.bytes, "MiB")
    assert cell_equals(block["host"][0], report.host.overall.bytes, "MiB")


def test_simulate_honours_unit_in_every_table(capsys):
    report = api.run(tiny(device="H100-80GB"))
    text = printed(capsys, "simulate", *TINY, "--unit", "GiB")
    ledger = section(text, "ledger at the peak (")
    assert unit_of(ledger[0]) == "GiB" and unit_of(section(text, "peak by phase (")[0]) == "GiB"
    total = next(line for line in ledger if line.split()[0] == "total").split()[1]
    assert cell_equals(total, report.peaks.overall.bytes, "GiB") and decimals(total) == 5  # 0.06521: 4 digits
    assert "MiB" not in "\n".join(ledger + section(text, "peak by phase ("))


def test_checkpointing_table_one_unit_per_column(capsys):
    rows = {r.label: r for r in policy_table(tiny(device="H100-80GB"))}
    text = printed(capsys, "checkpointing", *TINY)
    head, _, *body = text.splitlines()
    names = re.split(r"\s{2,}", head.strip())
    assert names[0] == "policy" and names[1].startswith("peak ") and names[3].startswith("host ")
    size, flops, time = names[1].split()[1], names[4].split()[1], names[6].split()[1]
    assert size in UNIT_BYTES and flops.endswith("FLOP") and time in ("ms", "s", "min", "h")
    per_flop = {"FLOP": 1, "kFLOP": 1e3, "MFLOP": 1e6, "GFLOP": 1e9, "TFLOP": 1e12}[flops]
    per_second = {"ms": 1e-3, "s": 1, "min": 60, "h": 3600}[time]
    seen = 0
    for line in body:
        if not line.strip():
            break
        label = line[:22].strip()
        if label not in rows or rows[label].error:
            continue
        r, seen = rows[label], seen + 1
        peak, host, recompute, step = line[22:35].strip(), line[44:57].strip(), line[57:75].strip(), line[-12:].strip()
        assert cell_equals(peak, r.peak, size)
        assert host == "-" if not r.host_activations else cell_equals(host, r.host_activations, size)
        assert abs(float(recompute) - r.recompute_flops / per_flop) <= 0.5 * 10 ** -decimals(recompute)
        assert abs(float(step) - r.step_time_s / per_second) <= 0.5 * 10 ** -decimals(step) and is_number(step)
    assert seen >= 4


def test_compare_table_in_one_unit(capsys):
    a, b = api.run(tiny(device="H100-80GB")), api.run(tiny(device="H100-80GB").with_changes(precision="fp32"))
    text = printed(capsys, "compare", *TINY, "--case", "a: precision=bf16-mixed", "--case", "b: precision=fp32")
    lines = text.splitlines()
    unit = lines[0].split()[0].strip("()")
    peak = lines[1].split()
    assert peak[0] == "peak" and cell_equals(peak[1], a.peaks.overall.bytes, unit) and \
        cell_equals(peak[2], b.peaks.overall.bytes, unit)
    at_peak = lines[lines.index("at the peak:") + 1:lines.index("peak reached at:")]
    for line in at_peak:
        name, *cells = line.split()
        for cell, r in zip(cells, (a, b)):
            row = [x for x in r.ledger if x.row == name]
            assert cell == "-" if not row else cell_equals(cell, row[0].bytes, unit), line


# -- the sweep's CSV -------------------------------------------------------------------------------------------

def test_sweep_csv_names_its_units_and_rounds_seconds_and_hours():
    base = build_scenario({"preset": "tiny"}, {"seq_len": 16}, {"device": "H100-80GB"})
    plan = DeadlineBudget(deadline_s=3600.0, target_tokens=10**9, memory_bytes=1 << 30)
    result = run_sweep(base, {"micro_batch": [1, 2]}, jobs=1, progress=False, budget=1 << 30, deadline=plan)
    rows = list(csv.DictReader(io.StringIO(to_csv(result))))
    header = list(rows[0])
    assert "mean_step_time_s" in header and "priced_step_time_s" in header
    assert "step_time_s" not in header and "step_time_used_s" not in header
    assert all(re.search(r"_(bytes|s|h)$", c) for c in header if c.endswith(("_bytes", "_s", "_h")))
    for row, point in zip(rows, result):
        r = point.result  # the JSON's values, unrounded
        for column, key in (("mean_step_time_s", "step_time_s"), ("priced_step_time_s", "step_time_used_s"),
                            ("wall_clock_h", "wall_clock_h"), ("gpu_hours", "gpu_hours"),
                            ("deadline_h", "deadline_h"), ("late_by_h", "late_by_h")):
            assert float(row[column]) == float(f"{r[key]:.4g}"), column  # 4 significant digits
            assert len(row[column].replace(".", "").replace("-", "").strip("0")) <= 4, row[column]
        for column in ("peak_bytes", "capacity_needed_bytes", "budget_bytes", "over_budget_bytes"):
            assert row[column] == str(r[column])  # whole bytes, as the JSON
    js = to_json(result, base, {"micro_batch": [1, 2]}, plan)
    assert '"step_time_s"' in js and '"step_time_used_s"' in js  # the JSON keeps its keys and full values
