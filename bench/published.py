"""The scoreboard of published measurements (issue 38): peakledger's prediction for each published GPU memory
figure of bench/published_cases.py, the error, and the error distribution.

    python bench/published.py            # print the table
    python bench/published.py --write    # and write the "Published measurements (scoreboard)" section of
                                         # bench/VALIDATION.md (the rest of the file is kept)
    python bench/published.py --only NAME [--only NAME ...]

Each modelled case runs `peakledger.api.run` on the scenario its knob values build (`build_scenario`, the same path
as `peakledger simulate`), on the device profile named, with the card's capacity as the budget where the profile's
differs (H100 96 GB). The figure compared is the one the source measured: `allocated` = the tensors' peak on the
device (torch.cuda.max_memory_allocated), `reserved` = the caching allocator's reserved peak (max_memory_reserved),
`nvidia-smi` = reserved + CUDA context + what lives outside the allocator, `active` = allocated (torch's
active_bytes peak counts the same live blocks). "model init" cases read the peak of the load phase (the memory
logged after model setup). A case that uses a technique of issue 38 (case.pending) is scored once its knob values
build a scenario (`builds`); until then it is listed with its knob values and no
prediction. Error = (predicted - published) / published; negative = under-predicted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

from published_cases import CASES, Case  # bench/published_cases.py, beside this script

from peakledger import api
from peakledger.models.config import ConfigError
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Phase

HEADING = "## Published measurements (scoreboard)"


@dataclass(frozen=True)
class Row:
    name: str
    published: float  # bytes
    predicted: float | None  # bytes; None = pending (no prediction)
    fully_stated: bool = True

    @property
    def error(self) -> float | None:
        """(predicted - published) / published, as a fraction; None when there is no prediction."""
        return None if self.predicted is None else (self.predicted - self.published) / self.published


@dataclass(frozen=True)
class Summary:
    cases: int  # every case listed
    modelled: int  # cases with a prediction
    median_abs_error: float | None  # fractions
    worst_abs_error: float | None
    worst: str  # the worst case's name
    under_predicted: int  # modelled cases predicted below the published figure
    not_fully_stated: int  # modelled cases whose setup the source leaves partly unstated
    pending: int  # cases waiting for a technique peakledger does not simulate yet


def summarize(rows: list[Row]) -> Summary:
    """The error distribution over the rows with a prediction: median and worst absolute relative error, how many
    are under-predicted, how many of them are not fully stated; and how many rows are pending."""
    scored = [r for r in rows if r.predicted is not None]
    errors = [abs(r.error) for r in scored]
    worst = max(scored, key=lambda r: abs(r.error)) if scored else None
    return Summary(
        cases=len(rows), modelled=len(scored),
        median_abs_error=statistics.median(errors) if errors else None,
        worst_abs_error=abs(worst.error) if worst else None, worst=worst.name if worst else "",
        under_predicted=sum(1 for r in scored if r.error < 0),
        not_fully_stated=sum(1 for r in scored if not r.fully_stated),
        pending=len(rows) - len(scored))


def predict(case: Case) -> int:
    """peakledger's figure for `case`, in bytes: the measured kind, at the case's moment."""
    scenario = build_scenario(dict(case.model), dict(case.training), {"device": case.device}, name=case.name)
    budget = int(case.budget_gib * 2**30) if case.budget_gib else None
    report = api.run(scenario, budget=budget)
    gpu = report.gpu
    if case.moment == "model init":
        load = next(p for p in report.phases if p.phase is Phase.LOAD)
        return {"allocated": load.allocated, "active": load.allocated, "reserved": load.reserved,
                "nvidia-smi": load.device_total}[case.measures]
    return {"allocated": report.peaks.overall.bytes, "active": report.peaks.overall.bytes,
            "reserved": gpu.reserved_peak.reserved, "nvidia-smi": gpu.total_peak.total}[case.measures]


def pending_state(case: Case) -> str:
    """Whether a pending case's knob values build a scenario yet: "knobs build" once the techniques' knobs have
    landed (then clear `pending` in bench/published_cases.py to score it), else peakledger's own one-line refusal,
    which names the knob it does not take yet."""
    try:
        build_scenario(dict(case.model), dict(case.training), {"device": case.device}, name=case.name)
    except ConfigError as error:
        return f"not yet: {str(error).splitlines()[0].split('; allowed')[0]}"
    return "knobs build"


def builds(case: Case) -> bool:
    """A case listed with the techniques it uses (`pending`) is scored once peakledger takes its knob values: the
    techniques have landed (issue 38), and what it still refuses keeps the case pending."""
    return bool(case.pending) and pending_state(case) == "knobs build"


def _size(nbytes: float, unit: str) -> str:
    return f"{nbytes / (2**30 if unit == 'GiB' else 1e9):.2f} {unit}"


def _pct(error: float | None) -> str:
    return "—" if error is None else f"{error * 100:+.1f}%"


def score(cases=CASES, log=print) -> list[tuple[Case, Row, float]]:
    out = []
    for case in cases:
        start = time.perf_counter()
        predicted = predict(case) if case.modelled or builds(case) else None
        row = Row(case.name, case.published_bytes, predicted, case.fully_stated)
        seconds = time.perf_counter() - start
        out.append((case, row, seconds))
        got = _size(predicted, case.unit) if predicted is not None else f"pending ({pending_state(case)})"
        log(f"{case.name:40s} {case.measures:9s} published {case.figure:7.2f} {case.unit:3s} predicted {got:>12s}"
            f" {_pct(row.error):>7s} ({seconds:.1f} s)")
    return out


def _knobs(case: Case) -> str:
    model = ", ".join(f"{k}={v}" for k, v in case.model.items())
    training = ", ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in case.training.items())
    budget = f", budget {case.budget_gib} GiB" if case.budget_gib else ""
    return f"model {model}; {training}; device {case.device}{budget}"


def _summary_lines(summary: Summary) -> list[str]:
    if summary.modelled == 0:
        return [f"- {summary.cases} cases, none modelled yet; {summary.pending} pending a technique."]
    return [
        f"- **{summary.cases} published cases**: {summary.modelled} modelled today, {summary.pending} pending a "
        "technique peakledger does not simulate yet (listed with the knob values they will run with).",
        f"- **Median absolute error {summary.median_abs_error * 100:.1f}%**, worst "
        f"{summary.worst_abs_error * 100:.1f}% ({summary.worst}).",
        f"- **Under-predicted: {summary.under_predicted} of {summary.modelled}** (a negative error: peakledger "
        "said less than the card used).",
        f"- Not fully stated: {summary.not_fully_stated} of the {summary.modelled} modelled cases (what each "
        "source leaves out, and the value taken, is under the table).",
    ]


def section(scored: list[tuple[Case, Row, float]], command: str) -> str:
    summary = summarize([row for _, row, _ in scored])
    lines = [
        HEADING, "",
        "Published GPU memory figures from the projects' own READMEs, docs, benchmark files and threads, against "
        "peakledger's prediction for the setup as stated (bench/published_cases.py holds every case as data; "
        "bench/published.py runs them). Nothing was tuned to a figure: where a source leaves part of the setup "
        "out, the case says so and takes the recipe config's or the library's default, named below.",
        "", f"Command: `{command}`", "",
        *_summary_lines(summary), "",
        "| case | source | measures | published | predicted | error | stated |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, row, _ in scored:
        got = _size(row.predicted, case.unit) if row.predicted is not None else "pending"
        lines.append(f"| {case.name} | {case.source.cite} | {case.measures}"
                     f"{' (model init)' if case.moment == 'model init' else ''} | {case.figure} {case.unit} | "
                     f"{got} | {_pct(row.error)} | {'yes' if case.fully_stated else 'not fully'} |")
    lines += ["", "### Each case: the setup as stated, what is assumed, the scenario", ""]
    for case, row, _ in scored:
        lines.append(f"- **{case.name}** — {case.setup}. Measures: {case.measures} ({case.measured_by}).")
        for item in case.unstated:
            lines.append(f"  - setup not fully stated: {item}")
        if case.mapping:
            lines.append(f"  - scenario differs: {case.mapping}")
        if case.pending and row.predicted is not None:
            lines.append(f"  - techniques it uses (modelled since issue 38): {'; '.join(case.pending)}")
        elif case.pending:
            lines.append(f"  - technique not yet modelled: {'; '.join(case.pending)}")
            lines.append(f"  - its knob values today: {pending_state(case)}")
        if case.notes:
            lines.append(f"  - note: {case.notes}")
        lines.append(f"  - scenario: {_knobs(case)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the section of bench/VALIDATION.md")
    parser.add_argument("--only", action="append", default=[], help="run only the named case(s)")
    args = parser.parse_args(argv)
    names = {c.name for c in CASES}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(f"bench/published.py: unknown case {unknown[0]!r}; allowed: {', '.join(sorted(names))}",
              file=sys.stderr)
        return 2
    cases = [c for c in CASES if not args.only or c.name in args.only]
    scored = score(cases)
    summary = summarize([row for _, row, _ in scored])
    print("\n".join(_summary_lines(summary)))
    if args.write:
        from sections import replace_section  # bench/sections.py, beside this script

        replace_section(HEADING, section(scored, "python bench/published.py --write"))
        print("wrote the scoreboard section of bench/VALIDATION.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
