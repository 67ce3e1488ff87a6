"""The hardening findings, before and after: every case run as a real command. Issues 11 and 23: the cases of
bench/hardening_cases.py (`--cases 11`, the default); issue 34: those of bench/hardening_cases_34.py (`--cases 34`).
Each set has its section of bench/HARDENING.md.

    python bench/hardening.py                                  # this tree: print the table
    python bench/hardening.py --before /path/to/old/venv/bin/python --write   # + an older install, into
                                                                              #   bench/HARDENING.md
    python bench/hardening.py --cases 34 --before /tmp/bv/bin/python --before-commit 3b41967 --write

Each case runs in a fresh temporary folder as its working directory, under a time limit (`--timeout`,
a case that runs on is "did not finish") and an address-space limit (`--memory`, so an unbounded run
ends as "out of memory" instead of taking the machine). An outcome is "traceback (<exception>)", "exit N:
<first message line>", or "exit 0" with what its check found ("wrong: ..."). A case is right when its
exit status and message or number are the ones tests/test_hardening.py asserts.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from hardening_cases import CASES, GPU_TRUTH, make_special_files  # bench/hardening_cases.py, beside this script
from hardening_cases_34 import CASES_34
from sections import replace_section  # bench/sections.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
RUNNER = "import sys; from peakledger.cli import main; sys.exit(main(sys.argv[1:]))"


def run_case(case, python: str, timeout: float, memory: int) -> tuple[bool, str]:
    """(right?, outcome in words) of one case run by `python`."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, make in case.files.items():
            (tmp / name).write_bytes(make())
        make_special_files(case, tmp)
        argv = [a.format(tmp=tmp, repo=ROOT, gpu=GPU_TRUTH, port="{port}") for a in case.argv]  # ({port}: the driver's)

        def limits():
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            if case.umask is not None:
                os.umask(case.umask)

        cmd = [python, "-c", RUNNER, *argv]
        try:
            if case.driver is not None:
                p = case.driver(cmd, tmp, timeout, limits)
            else:
                p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout, preexec_fn=limits,
                                   stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"did not finish in {timeout:.0f} s"
        text = (p.stdout + p.stderr).lower()
        if "Traceback" in p.stderr or p.returncode not in (0, 1, 2):
            last = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit {p.returncode}"]
            kind = "out of memory" if "MemoryError" in p.stderr else "traceback"
            return False, f"{kind} ({_short(last[0])})"
        said = next((ln for ln in p.stderr.splitlines() if ln.startswith("peakledger:")), "")
        outcome = f"exit {p.returncode}" + (f": {_short(said.removeprefix('peakledger: error: '))}" if said else "")
        right = p.returncode == case.code and all(s.lower() in text for s in case.says)
        if case.check is not None and p.returncode in (0, case.code):  # (an exit 2 may leave files, run code)
            try:
                problem = case.check(p.stdout, p.stderr, tmp)
            except Exception as e:  # an unreadable output is a wrong result
                problem = f"unreadable output ({type(e).__name__})"
            if problem:
                return False, f"{outcome}, wrong: {_short(problem)}"
        return right, outcome


def _short(text: str, n: int = 110) -> str:
    text = " ".join(text.split()).replace("|", "/")
    text = re.sub(r"/tmp/tmp[\w-]+", "{tmp}", text).replace(str(ROOT.parent) + "/", "../")
    text = re.sub(r"127\.0\.0\.1:[0-9]{4,5}\b", "127.0.0.1:{port}", text)  # (a driver's server: any free port)
    return text if len(text) <= n else text[: n - 3] + "..."


def render(rows: list[tuple], with_before: bool) -> str:
    head = "| case | finding | " + ("before | " if with_before else "") + "after | right |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    group = None
    for case, before, after, right in rows:
        if case.group != group:
            group = case.group
            lines.append(f"| **{group}** | | " + ("| " if with_before else "") + "| |")
        lines.append(f"| `{case.id}` | {_short(case.finding, 90)} | " + (f"{before} | " if with_before else "")
                     + f"{after} | {'yes' if right else 'NO'} |")
    return "\n".join(lines)


SETS = {"11": (CASES, "## Cases", "issues 11 and 23"), "34": (CASES_34, "## Issue 34", "issue 34")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", metavar="PYTHON", help="a python whose peakledger is the older version")
    ap.add_argument("--before-commit", default="3235a98", help="the commit that older version is (for the text)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--memory", type=int, default=16 << 30, help="address-space limit per case, bytes")
    ap.add_argument("--only", help="run the cases whose id contains this")
    ap.add_argument("--write", action="store_true", help="write bench/HARDENING.md")
    ap.add_argument("--cases", choices=SETS, default="11", help="which set: 11 (issues 11 and 23) or 34")
    args = ap.parse_args()
    cases, heading, issue = SETS[args.cases]
    rows = []
    before_wrong: dict[str, int] = {}
    for case in cases:
        if args.only and args.only not in case.id:
            continue
        before_right, before = run_case(case, args.before, args.timeout, args.memory) if args.before else (True, "")
        right, after = run_case(case, sys.executable, args.timeout, args.memory)
        rows.append((case, before, after, right))
        before_wrong[case.group] = before_wrong.get(case.group, 0) + (not before_right)
        print(f"{'ok ' if right else 'BAD'} {case.id:<28} {after}" + (f"   [before: {before}]" if before else ""),
              flush=True)
    table = render(rows, bool(args.before))
    wrong = sum(1 for r in rows if not r[3])
    summary = (f"{len(rows)} cases, {len(rows) - wrong} right now, {wrong} wrong" +
               (f"; before: {sum(1 for r in rows if r[1].startswith(('traceback', 'out of memory')))} tracebacks, "
                f"{sum(1 for r in rows if 'did not finish' in r[1])} did not finish in {args.timeout:.0f} s"
                if args.before else ""))
    groups = list(dict.fromkeys(r[0].group for r in rows))
    by_group = "; ".join(f"{g}: {sum(1 for r in rows if r[0].group == g and not r[3])} wrong now"
                         + (f" ({before_wrong.get(g, 0)} before)" if args.before else "") for g in groups)
    summary += f".\n\nWrong cases by kind: {by_group}"
    print(summary)
    if args.write:
        source, test = ("bench/hardening_cases.py", "tests/test_hardening.py") if args.cases == "11" else \
            ("bench/hardening_cases_34.py", "tests/test_hardening_34.py")
        text = (f"{heading}\n\n`python bench/hardening.py --cases {args.cases} --before OLD_PYTHON --before-commit SHA "
                f"--write` (cases: {source}, asserted by {test}; {issue}). Each case ran as a real command in a fresh "
                f"folder, {args.timeout:.0f} s "
                f"and {args.memory >> 30} GiB of address space at most. "
                f"'before' is the peakledger of commit {args.before_commit} "
                f"(before this work), 'after' this tree.\n\n{summary}.\n\n{table}\n")
        path = ROOT / "bench" / "HARDENING.md"
        if not path.exists():
            path.write_text("# Hardening: the findings of issues 11, 23 and 34, before and after\n")
        replace_section(heading, text, str(path))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
