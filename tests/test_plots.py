"""The pictures (analysis/plot.py): every plot command writes a PNG, the same bytes for the same input; the figures
carry the budget line, one colour per category, the legend outside the data; bad plot flags exit 2."""

from __future__ import annotations

import itertools

import pytest
from matplotlib.colors import to_hex, to_rgb

from peakledger import api
from peakledger.analysis.checkpointing import optimal_checkpointing, policy_table
from peakledger.analysis.device import gpu_memory
from peakledger.analysis.plot import (
    CATEGORY_COLOURS,
    STACK_ORDER,
    checkpointing_figure,
    compare_figure,
    setup_text,
    sweep_figure,
    timeline_figure,
)
from peakledger.analysis.units import UNITS, format_bytes
from peakledger.cli import main
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Category
from peakledger.simulator.timeline import timeline
from peakledger.sweep import SweepPoint

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["--preset", "tiny", "--micro-batch", "2", "--seq-len", "16"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def written_twice(capsys, tmp_path, *argv) -> bytes:
    """Run a plot command twice into two files: a PNG, byte for byte the same both times."""
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    for path in (first, second):
        code, _, err = run_cli(capsys, *argv, "--plot", path)
        assert code == 0, err
    assert first.read_bytes()[:8] == PNG
    assert first.read_bytes() == second.read_bytes()
    return first.read_bytes()


def lines_with(fig, gid: str) -> list:
    return [line for ax in fig.axes for line in ax.lines if line.get_gid() == gid]


def tiny(device: str = "H100-80GB", **training):
    run = {"device": device} | ({} if device == "cpu" else {"torch_version": "2.6"})  # the rules these were written for
    return build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, **training}, run)


# -- colours ---------------------------------------------------------------------------------------------------

def test_every_category_has_its_own_colour_far_from_the_others():
    assert set(CATEGORY_COLOURS) == set(Category) and sorted(STACK_ORDER) == sorted(Category)
    colours = [to_hex(c) for c in CATEGORY_COLOURS.values()]
    assert len(set(colours)) == len(Category)  # parameter and workspace were the same blue
    rgb = [to_rgb(c) for c in colours]
    closest = min(sum((a - b) ** 2 for a, b in zip(x, y)) ** 0.5 * 255 for x, y in itertools.combinations(rgb, 2))
    assert closest > 55


# -- occupancy ---------------------------------------------------------------------------------------------------

def test_timeline_figure_budget_setup_colours_zooms_and_legend_outside():
    scenario = tiny()
    budget = 600 << 20
    report = api.run(scenario, budget=budget)
    gpu = gpu_memory(report.log, report.peaks.rank, series=True)
    tl = timeline(report.log, report.peaks.rank)
    fig = timeline_figure(tl, "title", "MiB", gpu.series, budget=budget, headroom=0.1,
                          setup=setup_text(scenario, budget, "MiB"), outside=gpu.context,
                          capacity=("H100-80GB", 80 << 30))
    main_ax = fig.axes[0]
    (line,) = [x for x in main_ax.lines if x.get_gid() == "budget"]
    assert line.get_ydata()[0] == pytest.approx(budget / UNITS["MiB"])
    assert [x.get_gid() for x in main_ax.lines].count("usable") == 1  # headroom: what the run may use
    assert {"reserved", "device_total", "peak"} <= {x.get_gid() for x in main_ax.lines}
    assert not lines_with(fig, "capacity")  # 80 GiB is far off a 600 MiB picture's scale
    assert len(lines_with(fig, "budget")) == 3  # the main panel and both zooms (optimizer step, peak)
    title = fig._suptitle.get_text()
    assert "tiny" in title and "bf16-mixed" in title and "micro-batch 2 x seq 16" in title and "H100-80GB" in title
    drawn = {p.get_gid(): to_hex(p.get_facecolor()[0]) for p in main_ax.collections
             if (p.get_gid() or "").startswith("category:")}
    assert drawn and all(drawn[f"category:{c.value}"] == to_hex(CATEGORY_COLOURS[c]) for c in tl.by_category)
    assert "torch 2.6 rules, allocator default settings" in title  # whose allocator rules, with which settings
    e = report.peaks.overall.event
    assert (e.phase.value, e.step) == ("optimizer", 1)  # the peak: in step 1's optimizer step (states created)
    # step 1's optimizer step (a sliver of the whole run) has its own panel, here with the peak; then the last one's
    assert [ax.get_title() for ax in fig.axes[1:]] == [
        "A: zoom on the first optimizer step (step 1), where the peak is",
        "B: zoom on the last optimizer step (step 2)"]
    fig.draw_without_rendering()
    for ax in (main_ax, fig.axes[-1]):  # the categories' and the phases' legends: right of the data
        assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1


def test_timeline_title_names_the_allocator_settings_and_zooms_on_step_1s_optimizer_step():
    scenario = build_scenario({"preset": "tiny"}, {"micro_batch": 8, "seq_len": 64},
                              {"device": "H100-80GB", "alloc_conf": "expandable_segments:True",
                               "torch_version": "2.6"})
    report = api.run(scenario)
    gpu = gpu_memory(report.log, report.peaks.rank, series=True)
    fig = timeline_figure(timeline(report.log, report.peaks.rank), "title", None, gpu.series,
                          setup=setup_text(scenario), outside=gpu.context)
    assert "torch 2.6 rules, allocator expandable_segments:True" in fig._suptitle.get_text()
    e = report.peaks.overall.event
    titles = [ax.get_title() for ax in fig.axes[1:]]
    assert titles[0].startswith("A: zoom on the first optimizer step (step 1)")
    assert titles[1].startswith("B: zoom on the last optimizer step (step 2)")
    if (e.phase.value, e.step) not in (("optimizer", 1), ("optimizer", 2)):  # the peak elsewhere: its own panel
        assert titles[2:] == ["C: zoom on the peak"]
    assert fig.axes[0].get_ylabel() == "device memory (MiB)"  # no --unit: the unit of the data's size


def test_simulate_plot_same_bytes_and_with_an_oom_on_a_cpu_profile(capsys, tmp_path):
    written_twice(capsys, tmp_path, "simulate", *TINY, "--budget", "1GiB")
    written_twice(capsys, tmp_path, "simulate", *TINY, "--device", "cpu", "--budget", "2MiB")


def test_plot_timeline_marks_the_first_oom():
    budget = 2 << 20
    report = api.run(tiny("cpu", precision="fp32"), budget=budget)
    (oom,) = report.log.ooms
    fig = timeline_figure(timeline(report.log, report.peaks.rank), budget=budget, oom=(oom.event.time, oom.event.op))
    assert lines_with(fig, "oom")
    assert any("first OOM" in t.get_text() for t in fig.axes[0].get_legend().get_texts())


# -- checkpointing -----------------------------------------------------------------------------------------------

def test_checkpointing_figure_budget_chosen_set_and_offload_step_time():
    scenario = tiny(micro_batch=8, seq_len=64)
    rows = policy_table(scenario)
    by = {r.policy: r for r in rows}
    budget = (by["none"].capacity_needed + by["full"].capacity_needed) // 2
    chosen = optimal_checkpointing(scenario, budget)
    fig = checkpointing_figure(rows, unit="MiB", budget=budget, chosen=chosen, setup=setup_text(scenario, budget))
    mem, tim = fig.axes[:2]
    (line,) = [x for x in mem.lines if x.get_gid() == "budget"]
    assert line.get_xdata()[0] == pytest.approx(budget / UNITS["MiB"])
    bars = {p.get_gid(): p for p in mem.patches if p.get_gid()}
    assert "chosen" in bars and bars["chosen"].get_width() == pytest.approx(chosen.capacity_needed / UNITS["MiB"])
    times = {p.get_gid(): p.get_width() for p in tim.patches if p.get_gid()}
    # offload is not free: its step time shows, longer than no checkpointing's
    assert times["time:offload"] > times["time:none"] > 0
    # beside each bar: how far over the budget, or what it leaves (in the axis' unit)
    words = {t.get_text() for t in mem.texts}
    for r in [*rows, chosen]:
        if getattr(r, "error", None) is None:
            need = r.capacity_needed
            size = lambda n: format_bytes(n, "MiB")  # noqa: E731
            said = f"{size(need)}: over by {size(need - budget)}" if need > budget else \
                f"{size(need)}: fits, {size(budget - need)} to spare"
            assert any(w.startswith(said) for w in words), said
    labels = [t.get_text() for t in mem.get_yticklabels()]
    assert labels[-1].startswith("chosen: layers") and "offload" in labels
    assert any(t.get_text().startswith("n/a") for t in mem.texts) or all(r.error is None for r in rows)


def test_checkpointing_plot_cli(capsys, tmp_path):
    written_twice(capsys, tmp_path, "checkpointing", *TINY, "--budget", "560MiB", "--unit", "MiB")


# -- compare -----------------------------------------------------------------------------------------------------

def test_compare_figure_stacks_categories_with_budget_and_reserved():
    cases = [(name, api.run(tiny(**changes))) for name, changes in
             (("fp32", {"precision": "fp32"}), ("bf16", {}), ("full", {"checkpointing": "full"}))]
    budget = 580 << 20
    fig = compare_figure(cases, "MiB", budget=budget)
    ax = fig.axes[0]
    (line,) = [x for x in ax.lines if x.get_gid() == "budget"]
    assert line.get_ydata()[0] == pytest.approx(budget / UNITS["MiB"])
    assert [x.get_gid() for x in ax.lines].count("reserved") == 3
    stacked = {p.get_gid() for p in ax.patches}
    assert "category:parameter" in stacked and "category:optimizer_state" in stacked
    fp32 = cases[0][1].peaks.overall
    height = sum(p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2) < 1e-9)
    assert height == pytest.approx(fp32.bytes / UNITS["MiB"])


def test_compare_plot_cli(capsys, tmp_path):
    written_twice(capsys, tmp_path, "compare", *TINY, "--budget", "600MiB", "--case", "a: precision=fp32",
                  "--case", "b: checkpointing=full")
    code, out, _ = run_cli(capsys, "compare", *TINY, "--budget", "600MiB", "--unit", "MiB",
                           "--case", "a: precision=fp32")
    assert code == 0 and "budget 600 MiB per rank: a fits" in out


# -- sweep -------------------------------------------------------------------------------------------------------

def fake_points(grid: dict, budget: int) -> list[SweepPoint]:
    out = []
    for i, combo in enumerate(itertools.product(*grid.values())):
        needed = (i + 1) << 30
        result = {"peak_bytes": needed - (1 << 28), "capacity_needed_bytes": needed, "fits": needed <= budget,
                  "error": ""}
        if i == 1:
            result = {"peak_bytes": "", "capacity_needed_bytes": "", "fits": "", "error": "invalid together"}
        out.append(SweepPoint(dict(zip(grid, combo)), result))
    return out


def test_sweep_figure_line_heatmap_and_lines_with_budget():
    budget = 3 << 30
    one = {"micro_batch": [1, 2, 4, 8]}
    fig = sweep_figure(one, fake_points(one, budget), budget=budget)
    (line,) = lines_with(fig, "budget")
    assert line.get_ydata()[0] == pytest.approx(3.0)
    assert lines_with(fig, "over")  # points past the budget are marked
    two = {"micro_batch": [1, 2, 4], "checkpointing": ["none", "full"]}
    fig = sweep_figure(two, fake_points(two, budget), budget=budget)
    assert lines_with(fig, "budget")  # on the colour bar
    assert any(p.get_gid() == "over" for p in fig.axes[0].patches)
    assert any(t.get_text() == "n/a" for t in fig.axes[0].texts)
    # the colour scale spans the data (min..max of the valid points), not 0..the budget
    needed = [float(p.result["capacity_needed_bytes"]) / UNITS["GiB"] for p in fake_points(two, budget)
              if not p.result["error"]]
    (image,) = [im for im in fig.axes[0].images if im.get_gid() == "heatmap"]
    assert image.get_clim() == (pytest.approx(min(needed)), pytest.approx(max(needed)))
    assert min(needed) < budget / UNITS["GiB"] < max(needed) and lines_with(fig, "budget")  # inside: marked
    far = 40 << 30  # a budget off the data's scale: not drawn, said in the colour bar's label
    fig = sweep_figure(two, fake_points(two, far), budget=far)
    (image,) = [im for im in fig.axes[0].images if im.get_gid() == "heatmap"]
    assert image.get_clim() == (pytest.approx(min(needed)), pytest.approx(max(needed)))
    assert not lines_with(fig, "budget") and "off this scale (every point under it)" in fig.axes[1].get_ylabel()
    three = {"micro_batch": [1, 2], "checkpointing": ["none", "full"], "zero_stage": [0, 3]}
    fig = sweep_figure(three, fake_points(three, budget), budget=budget)
    assert len([x for x in fig.axes[0].lines if (x.get_gid() or "").startswith("line:")]) == 4


def test_sweep_plot_cli_alone_and_the_same_bytes(capsys, tmp_path):
    written_twice(capsys, tmp_path, "sweep", *TINY, "--grid", "micro_batch=1,2", "--grid", "precision=fp32,bf16-mixed",
                  "--budget", "600MiB", "--jobs", "1")


# -- bad flags ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["compare", *TINY, "--peers", "--plot", "{tmp}/x.png"], "--peers"),
    (["compare", *TINY, "--plot", "{tmp}/no/x.png"], "does not exist"),
    (["compare", *TINY, "--budget", "80"], "no unit"),
    (["checkpointing", *TINY, "--plot", "{tmp}/no/x.png"], "does not exist"),
    (["sweep", *TINY, "--grid", "micro_batch=1,2", "--plot", "{tmp}/no/x.png"], "does not exist"),
    (["sweep", *TINY, "--grid", "micro_batch=1,2", "--grid", "seq_len=8,16,32,64", "--grid", "precision=fp32,bf16",
      "--grid", "zero_stage=0,1", "--plot", "{tmp}/x.png"], "16 lines"),
    (["simulate", *TINY, "--plot", ""], "empty path"),
])
def test_bad_plot_flags_exit_2_before_any_work(capsys, tmp_path, argv, says):
    code, out, err = run_cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2 and says in err and out == ""
    assert not list(tmp_path.rglob("*.png"))
