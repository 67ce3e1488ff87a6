"""The HTML report (`simulate --html`, `explain --html`; analysis/export_html.py): one self-contained file whose
embedded run rebuilds the timeline exactly, written the same byte for byte; and, in a real headless Chromium
(bench/html_report_browser.py; .ci/run installs the Debian packages), a page that loads without console errors,
shows the peak and every ledger row, lists at the peak the tensors the API finds live there, writes sizes as
analysis/units.py does, zooms, and draws the peak at its height in a screenshot."""

from __future__ import annotations

import html
import io
import json
import re

import html_report_browser as browser
import numpy as np
import pytest
from tables import cell_equals

from peakledger import api, build_scenario
from peakledger.analysis.export_html import TOP_TENSORS, timeline_data
from peakledger.analysis.palette import CATEGORY_COLOURS
from peakledger.analysis.units import format_bytes
from peakledger.cli import main

TINY = ["--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--device", "H100-80GB"]
OVER = "530MiB"  # the tiny run's device total (its tensors and the 512 MiB CUDA context) is over it


@pytest.fixture(scope="module")
def report():
    return api.run(build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16}, {"device": "H100-80GB"}))


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """simulate --html on the card (fits: no fixes), over a budget (fixes) and on the cpu profile (no card, no
    allocator: the tensors fill the chart), explain --html, and explain's text."""
    d = tmp_path_factory.mktemp("html")
    paths = {name: d / f"{name}.html" for name in ("fits", "over", "explain", "cpu")}
    out = io.StringIO()
    from contextlib import redirect_stdout

    with redirect_stdout(out):
        assert main(["simulate", *TINY, "--html", str(paths["fits"])]) == 0
        assert main(["simulate", *TINY[:-1], "cpu", "--html", str(paths["cpu"])]) == 0
        assert main(["simulate", *TINY, "--budget", OVER, "--html", str(paths["over"])]) == 0
    text = io.StringIO()
    with redirect_stdout(text):
        assert main(["explain", *TINY, "--budget", OVER, "--html", str(paths["explain"])]) == 0
    return paths, text.getvalue()


def _data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="peakledger-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def _fix_names(page: str) -> list[str]:
    table = re.search(r'<table id="fixes-table">(.*?)</table>', page, re.S).group(1)
    return [html.unescape(re.sub(r"<[^>]+>", "", row.split("</td>")[0])) for row in table.split("<tr>")[2:]]


# --- the file ---------------------------------------------------------------------------------------------------

def test_the_embedded_run_rebuilds_every_category_the_reserved_bytes_and_the_live_tensors(report):
    tl, gpu = report.timeline, report.gpu_series
    d = timeline_data(tl, gpu)
    n = len(tl.events)
    b = d["blocks"]
    starts = np.cumsum(b["start"])
    ends = starts + np.array(b["len"])
    for k, cat in enumerate(d["cats"]):  # each category's bytes after every event, from the tensors' intervals
        diff = np.zeros(n + 1, dtype=np.int64)
        for s, e, size, c in zip(starts, ends, b["size"], b["cat"]):
            if c == k:
                diff[s] += size
                diff[e] -= size
        rebuilt = np.cumsum(diff[:n])
        assert np.array_equal(rebuilt, next(v for c, v in tl.by_category.items() if c.value == cat["name"]))
    assert {c["name"] for c in d["cats"]} == {c.value for c in tl.by_category}
    i = report.peaks.overall.index
    live = sorted(((d["names"][name], size) for s, e, size, name in zip(starts, ends, b["size"], b["name"])
                   if s <= i < e), key=lambda x: -x[1])
    assert live == [(blk.name, blk.nbytes) for blk in sorted(tl.live_blocks_at(i), key=lambda blk: -blk.nbytes)]
    reserved, k = [], 0
    for j in range(n):
        while k < len(d["reserved"]) and d["reserved"][k][0] <= j:
            k += 1
        reserved.append(d["reserved"][k - 1][1])
    assert reserved == [r for _, _, r in gpu.series] and d["outside"] == gpu.outside_total
    assert [d["names"][o] for o in d["ops"]] == [e.op for e in tl.events]
    assert np.allclose(np.cumsum(d["t_ns"]) * 1e-9, tl.times, atol=1e-9)
    bands = d["bands"]
    assert bands[0][0] == 0 and bands[-1][1] == n and all(a[1] == z[0] for a, z in zip(bands, bands[1:]))
    assert {p.label for p in report.phases} <= {band[3] for band in bands}


def test_the_page_is_one_self_contained_file_written_the_same_each_time(pages, report, tmp_path):
    paths, _ = pages
    page = paths["fits"].read_text()
    assert not re.search(r"\b(src|href)\s*=", page) and "<link" not in page and "@import" not in page
    assert set(re.findall(r"https?://[^\s\"'<>]*", page)) == {"http://www.w3.org/2000/svg"}  # the SVG namespace only
    again = tmp_path / "again.html"
    with io.StringIO() as out:
        from contextlib import redirect_stdout

        with redirect_stdout(out):
            assert main(["simulate", *TINY, "--html", str(again)]) == 0
    assert again.read_bytes() == paths["fits"].read_bytes()
    data = _data(page)
    assert data["peak"] == {"index": report.peaks.overall.index, "bytes": report.peaks.overall.bytes}
    assert data["n"] == len(report.timeline.events)
    assert f'id="peak-value">{format_bytes(report.peaks.overall.bytes)}<' in page


def test_fixes_are_shown_when_the_run_does_not_fit_its_card_and_are_explains_own(pages):
    paths, explain_text = pages
    fits, over, explained = (paths[k].read_text() for k in ("fits", "over", "explain"))
    assert 'id="fixes"' not in fits and 'id="verdict-value">fits<' in fits
    assert 'id="verdict-value"' not in paths["cpu"].read_text()  # the cpu profile is no card
    assert 'id="verdict-value">does not fit<' in over and 'id="verdict-value">does not fit<' in explained
    lines = explain_text.splitlines()
    head = next(k for k, line in enumerate(lines) if line.startswith("  fix "))
    end = lines.index("", head)  # (the table ends at a blank line; what the run assumed follows)
    names_end = lines[head].index("  fits") - 14  # the names' column ends where the 14-wide peak column begins
    names = [line[2:names_end].rstrip() for line in lines[head + 1:end]]
    assert names and _fix_names(over) == names and _fix_names(explained) == names
    assert "where it runs out: " in explained


@pytest.mark.parametrize("argv, words", [
    (["simulate", *TINY, "--html", "/nonexistent-folder/r.html"], "--html"),
    (["simulate", *TINY, "--html", "same.html", "--plot", "same.html"], "give two different files"),
    (["explain", "--trace", "t.json", "--budget", "1GiB", "--html", "r.html"], "--html"),
])
def test_bad_html_flags_are_one_line_and_exit_2(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err


# --- in a real browser ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def driver():
    reason = browser.missing()
    if reason:
        pytest.skip(reason)
    with browser.chromium() as d:
        yield d


def test_the_page_loads_without_console_errors_and_shows_the_peak_and_every_ledger_row(driver, pages, report):
    paths, _ = pages
    for name in ("fits", "over", "explain"):
        logs = browser.open_report(driver, paths[name])
        assert not [m for m in logs if m["level"] in ("SEVERE", "WARNING")], (name, logs)
    browser.open_report(driver, paths["fits"])
    assert driver.find_element("id", "peak-value").text == format_bytes(report.peaks.overall.bytes)
    ledger = driver.find_elements("css selector", "#ledger-table tr")[1:]
    cells = [[td.text for td in r.find_elements("tag name", "td")] for r in ledger]
    assert [c[0] for c in cells] == [row.row for row in report.ledger] + ["total"]
    unit = re.search(r"Ledger at the peak \((\w+);", driver.find_element("css selector", "#ledger h2").text).group(1)
    for c, row in zip(cells, report.ledger):  # one unit for the table: each cell the API's bytes in it
        assert cell_equals(c[1], row.bytes, unit) and cell_equals(c[6], row.max_bytes, unit), (c, row)
    assert cell_equals(cells[-1][1], sum(row.bytes for row in report.ledger), unit)
    assert len(driver.find_elements("css selector", "#phases-table tr")) == len(report.phases) + 1


def test_the_pointer_on_the_peak_lists_the_tensors_the_api_finds_live_there(driver, pages, report):
    paths, _ = pages
    browser.open_report(driver, paths["fits"])
    tip = browser.hover_peak(driver)
    i = report.peaks.overall.index
    assert tip.is_displayed() and tip.get_attribute("data-event") == str(i)
    assert f"allocated {format_bytes(report.peaks.overall.bytes)}" in tip.text
    live = sorted(report.timeline.live_blocks_at(i), key=lambda b: -b.nbytes)
    assert browser.tooltip_tensors(driver) == [(format_bytes(b.nbytes), b.category.value, b.name)
                                               for b in live[:TOP_TENSORS]]
    rest = sum(b.nbytes for b in live[TOP_TENSORS:])
    assert f"+ {len(live) - TOP_TENSORS:,} more tensors, {format_bytes(rest)}" in tip.text
    box = tip.rect  # the tooltip stays inside the window
    assert box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= browser.VIEWPORT[0]
    assert box["y"] + box["height"] <= browser.VIEWPORT[1]


SIZES = [0, 1, 512, 1023, 1024, 1536, 10**6, 12_345_678, 2**30, 1_140_850_688, 2**30 - 1, 123_456_789_012,
         999_950_000, 10_737_418, 10_737_417, 7_549_747_200, 192_793_378_944, 5 * 2**40, 3 * 10**15]


def test_sizes_in_the_page_are_written_as_analysis_units_writes_them(driver, pages):
    paths, _ = pages
    browser.open_report(driver, paths["fits"])
    for unit in ("GiB", "GB", "MiB", "MB", "B"):
        page = driver.execute_script("return arguments[0].map(n => window.peakledger.formatBytes(n, arguments[1]))",
                                     SIZES, unit)
        assert page == [format_bytes(n, unit) for n in SIZES], unit


def test_wheel_drag_and_double_click_zoom_the_timeline(driver, pages, report):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin

    paths, _ = pages
    browser.open_report(driver, paths["fits"])
    n = len(report.timeline.events)
    chart = driver.find_element("id", "chart")
    view = lambda: driver.execute_script("return window.peakledger.view()")  # noqa: E731
    assert view() == [0, n]
    ActionChains(driver).scroll_from_origin(ScrollOrigin.from_element(chart), 0, -300).perform()
    a, z = view()
    assert 0 <= a < z <= n and z - a < n
    ActionChains(driver).double_click(chart).perform()
    assert view() == [0, n]
    width = chart.rect["width"]
    ActionChains(driver).move_to_element_with_offset(chart, -width // 4, 0).click_and_hold() \
        .move_by_offset(width // 4, 0).release().perform()
    a, z = view()
    assert 0 < a < z < n and z - a < n / 2
    driver.execute_script(f"window.peakledger.zoom({report.peaks.overall.index - 10}, "
                          f"{report.peaks.overall.index + 10})")
    assert browser.hover_peak(driver).get_attribute("data-event") == str(report.peaks.overall.index)


@pytest.fixture(scope="module")
def cpu_report():
    return api.run(build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16}, {"device": "cpu"}))


def test_the_screenshot_draws_the_peak_at_its_height_in_the_categories_colours(driver, pages, cpu_report):
    from matplotlib import image

    paths, _ = pages
    report = cpu_report
    browser.open_report(driver, paths["cpu"])
    i = report.peaks.overall.index
    driver.execute_script(f"window.peakledger.zoom({i - 10}, {i + 11})")  # the peak's event some 50 pixels wide
    marker = driver.find_element("id", "peak-marker")
    x = round(float(marker.get_attribute("cx")) + driver.find_element("id", "chart").rect["x"])
    svg_top = driver.find_element("id", "chart").rect["y"]
    grid = [(float(g.get_attribute("data-bytes")), float(g.get_attribute("y1")) + svg_top)
            for g in driver.find_elements("css selector", "#chart line.grid")]
    (b0, y0), (b1, y1) = grid[0], grid[-1]
    expected = y0 + (y1 - y0) * (report.peaks.overall.bytes - b0) / (b1 - b0)
    driver.execute_script("for (const id of ['peak-marker', 'tooltip', 'cursor']) { const e = "
                          "document.getElementById(id); if (e) e.style.display = 'none'; }"
                          "document.querySelector('.peak-label').style.display = 'none';")
    png = image.imread(io.BytesIO(driver.get_screenshot_as_png()), format="png")
    assert png.shape[:2] == (browser.VIEWPORT[1], browser.VIEWPORT[0])
    rgb = np.rint(png[..., :3] * 255).astype(int)
    colours = {tuple(c) for c in rgb.reshape(-1, 3)[::7]}
    assert len(colours) > 50  # not blank
    drawn = {tuple(int(c[k:k + 2], 16) for k in (1, 3, 5)): cat for cat, c in CATEGORY_COLOURS.items()}
    top = next(y for y in range(int(y1), int(y0) + 1) if tuple(rgb[y, x]) in drawn)  # the stack's top at the peak
    assert abs(top - expected) <= 3, (top, expected)
    column = {drawn[tuple(rgb[y, x])] for y in range(int(y1), int(y0) + 1) if tuple(rgb[y, x]) in drawn}
    live = report.peaks.overall.live_by_category
    tall = {c for c, v in live.items() if v * (y0 - y1) / (b1 - b0) >= 3}  # 3 pixels and more
    assert len(tall) >= 3 and tall <= column <= {c for c, v in live.items() if v}
