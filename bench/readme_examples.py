"""Run every example of README.md's "## Will my run fit?" and "## Tasks" blocks and of docs/commands.md's
"# Commands (reference)" block, N times in a row, and report what passes.

    python bench/readme_examples.py                 # 20 runs of every command
    python bench/readme_examples.py --runs 1        # one pass
    python bench/readme_examples.py --only explain  # a subset (plus the commands it depends on)
    python bench/readme_examples.py --write         # also write the table into bench/RESULTS.md

The README and docs/commands.md are the single source of the examples: the script parses every fenced block
of README.md's "## Will my run fit?" and "## Tasks" sections, then the first one after docs/commands.md's
"# Commands (reference)" heading (a section ends at the next heading of its level or above), one command a
line (a trailing backslash continues a line; blank lines and lines starting with `#` are skipped), and splits
each line as bash would (quotes, and a `#` that starts a word begins the trailing comment). Nothing is copied
from either file into this file; "README order" below means README.md's sections, then docs/commands.md.

How a command runs:
  * the program `peakledger` is the one next to sys.executable (the venv's), else `.venv/bin/peakledger`,
    else the one on PATH; `python` is sys.executable; any other program is looked up on PATH;
  * every run (1..N) gets a fresh temporary directory as the working directory, and the commands run in
    it one after another in README order, so a command that reads an earlier one's output
    (`explain --trace t.json` after `capture ... --output t.json`) finds it, and every output file
    (t.json, s.csv, ck.png, sim.pickle ...) lands there, never in the repository;
  * an argument (or the value of `--flag=value`) that names a file or folder git tracks in the
    repository (examples/..., traces/data/...) is replaced by its absolute path in the repository;
    peakledger's command name is not a path (`peakledger models` is the command, not the models/ folder).
    Only tracked paths are resolved, so an output name that happens to lie around in the checkout
    (an untracked t.json) is still written in the temporary directory.

A run passes when the exit status is the expected one (0; a `--tolerance` command must exit 0 too)
and stderr has no "Traceback".

Commands this machine may lack the means for are marked in the README or docs/commands.md by their
trailing comment:

    peakledger capture --device-kind cuda --output t.json   # needs a CUDA GPU: ...

A comment that starts with "needs a CUDA GPU" makes the expectation depend on the machine: where
torch.cuda.is_available() (asked of sys.executable's torch) the command must exit 0; elsewhere it must
refuse cleanly: exit 2 (peakledger's usage/config error) with a message naming CUDA on stderr, and no
Traceback. The table says which expectation applied.

`--only SUBSTRING` keeps the commands whose text (README.md or docs/commands.md) contains SUBSTRING, plus
the earlier commands they depend on: a selected command's argument that looks like a file name (`name.ext`),
is not a tracked repository path, and appears in an earlier command (the latest such) pulls that command in.

Output: a table of command, runs, passes, failures (count and, for the first failing run, the most
telling stderr line: the exception line of a Traceback with its innermost frame, else the first
non-empty line) and median
seconds, then the time of one pass. Exit status 1 if any command failed a run, else 0. With
`--write`, the table goes into bench/RESULTS.md as the "## README examples" section
(bench/sections.py's replace_section; the other sections are kept).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
README = os.path.join(ROOT, "README.md")
COMMANDS = os.path.join(ROOT, "docs", "commands.md")
RESULTS = os.path.join(BENCH, "RESULTS.md")
HEADING = "## README examples"
CUDA_MARK = "needs a CUDA GPU"
FILE_LIKE = re.compile(r"^[^-=/][^=]*\.[A-Za-z][A-Za-z0-9]*$")


@dataclass
class Example:
    line: str                      # the README command, without its trailing comment
    comment: str                   # the trailing comment, without '#'
    argv: list[str]                # split as bash would, before resolution
    runs: int = 0
    passes: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    expect: str = "exit 0"


# ---------------------------------------------------------------- parsing the README

# the runnable sections, (file, heading, every block or the first): README.md's two, docs/commands.md's block
SECTIONS = (("README.md", "## Will my run fit?", True), ("README.md", "## Tasks", True),
            ("docs/commands.md", "# Commands (reference)", False))


def _level(line: str) -> int:
    """The level of a markdown heading line ('## x': 2), 0 for any other line."""
    hashes = len(line) - len(line.lstrip("#"))
    return hashes if hashes and line[hashes:hashes + 1] == " " else 0


def _blocks(lines: list[str], heading: str, every: bool, name: str = "README.md") -> list[str]:
    """The lines of the fenced blocks after `heading` (before the next heading of its level or above): all of
    them, or the first."""
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    except StopIteration:
        raise SystemExit(f"{name} has no '{heading}' heading") from None
    level = _level(heading)
    block, inside, found = [], False, 0
    for line in lines[start + 1:]:
        if not inside and 0 < _level(line) <= level:
            break
        if line.strip().startswith("```"):
            if inside:
                found += 1
                if not every:
                    return block
            inside = not inside
            continue
        if inside:
            block.append(line)
    if inside or not found:
        raise SystemExit(f"{name}'s '{heading}' section has no closed fenced block")
    return block


def commands_block(texts: dict[str, str]) -> list[str]:
    """The command lines of the runnable sections (SECTIONS), in README order; `texts` maps each file named in
    SECTIONS (README.md, docs/commands.md) to its text."""
    return [line for name, heading, every in SECTIONS
            for line in _blocks(texts[name].splitlines(), heading, every, name)]


def split_comment(line: str) -> tuple[str, str]:
    """Split a bash line into (command, trailing comment): a '#' outside quotes that starts a word."""
    quote, escaped = None, False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def parse_examples(texts: dict[str, str]) -> list[Example]:
    examples, pending = [], ""
    for raw in commands_block(texts):
        if pending:
            raw = pending + " " + raw.lstrip()
            pending = ""
        if raw.rstrip().endswith("\\") and not raw.rstrip().endswith("\\\\"):
            pending = raw.rstrip()[:-1].rstrip()
            continue
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        line, comment = split_comment(raw.strip())
        examples.append(Example(line=line, comment=comment, argv=shlex.split(line)))
    if pending:
        line, comment = split_comment(pending.strip())
        examples.append(Example(line=line, comment=comment, argv=shlex.split(line)))
    return examples


# ---------------------------------------------------------------- running

def peakledger_exe() -> str:
    candidates = [os.path.join(os.path.dirname(sys.executable), "peakledger"),
                  os.path.join(ROOT, ".venv", "bin", "peakledger")]
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    found = shutil.which("peakledger")
    if not found:
        raise SystemExit("no peakledger executable next to sys.executable, in .venv/bin or on PATH")
    return found


def tracked_paths() -> set[str] | None:
    """Every file git tracks in the repository and every folder above one, repository-relative."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = set()
    for name in out.decode(errors="replace").split("\0"):
        if not name:
            continue
        parts = name.split("/")
        for i in range(1, len(parts) + 1):
            paths.add("/".join(parts[:i]))
    return paths


def repo_path(token: str, tracked: set[str] | None) -> str | None:
    """The absolute repository path a command argument names, or None when it names none."""
    if not token or os.path.isabs(token) or token.startswith("-"):
        return None
    norm = os.path.normpath(token)
    if norm.startswith(".."):
        return None
    if tracked is not None:
        return os.path.join(ROOT, norm) if norm in tracked else None
    # without git: an existing path with a folder part (never a bare output name like t.json)
    full = os.path.join(ROOT, norm)
    return full if "/" in norm and os.path.exists(full) else None


def resolve(argv: list[str], tracked: set[str] | None, exe: str) -> list[str]:
    out = []
    for i, tok in enumerate(argv):
        if i == 0:
            out.append(exe if tok == "peakledger" else sys.executable if tok in ("python", "python3")
                       else (shutil.which(tok) or tok))
            continue
        if i == 1 and argv[0] == "peakledger" and not tok.startswith("-"):  # the command: models, not models/
            out.append(tok)
            continue
        if tok.startswith("--") and "=" in tok:
            flag, value = tok.split("=", 1)
            full = repo_path(value, tracked)
            out.append(f"{flag}={full}" if full else tok)
            continue
        path, colon, factory = tok.rpartition(":")  # --module FILE.py:FACTORY names a tracked file too
        full = repo_path(tok, tracked) or (colon and factory.isidentifier() and repo_path(path, tracked))
        out.append(full + f":{factory}" if full and not repo_path(tok, tracked) else full or tok)
    return out


def cuda_available() -> bool:
    try:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and r.stdout.strip().endswith("True")


def telling_line(stderr: str, stdout: str, code: int) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if "Traceback" in stderr and lines:
        frames = re.findall(r'File "([^"]+)", line (\d+)', stderr)
        if frames:
            path, line = frames[-1]
            path = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else os.path.basename(path)
            return f"{lines[-1]} (at {path}:{line})"
        return lines[-1]
    if lines:
        return lines[0]
    out = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    return f"exit {code}, no stderr" + (f"; stdout: {out[-1]}" if out else "")


def check(ex: Example, code: int, stderr: str, needs_cuda_missing: bool) -> str | None:
    """None when the run passes, else why it failed (one line)."""
    if code in (124, 137) and stderr.startswith("timed out"):
        return stderr
    if "Traceback" in stderr:
        return f"exit {code}, Traceback: {telling_line(stderr, '', code)}"
    if needs_cuda_missing:
        if code != 2:
            return f"exit {code} (expected 2: no CUDA here): {telling_line(stderr, '', code)}"
        if "cuda" not in stderr.lower():
            return f"exit 2 without a message naming CUDA: {telling_line(stderr, '', code)}"
        return None
    if code != 0:
        return f"exit {code}: {telling_line(stderr, '', code)}"
    return None


def run_one(argv: list[str], cwd: str, timeout: float) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        code, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        code, out, err = 124, "", f"timed out after {timeout:.0f} s"
    return code, out, err, time.perf_counter() - t0


def with_prerequisites(examples: list[Example], selected: list[int], tracked: set[str] | None) -> list[int]:
    keep = set(selected)
    todo = list(selected)
    while todo:
        i = todo.pop()
        for tok in examples[i].argv[1:]:
            value = tok.split("=", 1)[1] if tok.startswith("--") and "=" in tok else tok
            if not FILE_LIKE.match(value) or repo_path(value, tracked):
                continue
            for j in range(i - 1, -1, -1):
                if value in examples[j].argv[1:] or any(a.endswith("=" + value) for a in examples[j].argv[1:]):
                    if j not in keep:
                        keep.add(j)
                        todo.append(j)
                    break
    return sorted(keep)


# ---------------------------------------------------------------- report

def md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(examples: list[Example]) -> list[str]:
    rows = ["| command | expects | runs | passes | failures | median s |", "|---|---|---|---|---|---|"]
    for ex in examples:
        med = f"{statistics.median(ex.seconds):.2f}" if ex.seconds else ""
        fail = (f"{len(ex.failures)}: {md_cell(ex.failures[0])}" if ex.failures else "0")
        rows.append(f"| `{md_cell(ex.line)}` | {ex.expect} | {ex.runs} | {ex.passes} | {fail} | {med} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="passes over the commands (default 20)")
    p.add_argument("--only", metavar="SUBSTRING",
                   help="run the commands whose README text contains SUBSTRING (and those they depend on)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one command may run (default 900)")
    p.add_argument("--jobs", type=int, default=1,
                   help="passes run side by side (each pass keeps README order in its own folder; default 1)")
    p.add_argument("--write", action="store_true", help=f"write the table into bench/RESULTS.md as '{HEADING}'")
    p.add_argument("--readme", default=README, help=argparse.SUPPRESS)
    p.add_argument("--commands", default=COMMANDS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")

    examples = parse_examples({"README.md": open(args.readme).read(), "docs/commands.md": open(args.commands).read()})
    if not examples:
        raise SystemExit("the runnable sections of README.md and docs/commands.md have no commands")
    tracked = tracked_paths()
    indices = list(range(len(examples)))
    if args.only:
        chosen = [i for i, ex in enumerate(examples) if args.only in ex.line]
        if not chosen:
            raise SystemExit(f"no README command contains {args.only!r}")
        indices = with_prerequisites(examples, chosen, tracked)
    examples = [examples[i] for i in indices]

    exe = peakledger_exe()
    has_cuda = cuda_available() if any(ex.comment.startswith(CUDA_MARK) for ex in examples) else False
    for ex in examples:
        if ex.comment.startswith(CUDA_MARK):
            ex.expect = "exit 0 (CUDA here)" if has_cuda else "exit 2 + CUDA message (no CUDA here)"
    resolved = [resolve(ex.argv, tracked, exe) for ex in examples]

    pass_seconds = []
    lock = threading.Lock()

    def one_pass(run: int) -> None:
        t_pass = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="peakledger-readme-") as tmp:
            for k, (ex, cmd) in enumerate(zip(examples, resolved), 1):
                code, out, err, secs = run_one(cmd, tmp, args.timeout)
                why = check(ex, code, err, ex.comment.startswith(CUDA_MARK) and not has_cuda)
                with lock:
                    ex.runs += 1
                    ex.seconds.append(secs)
                    if why is None:
                        ex.passes += 1
                    else:
                        ex.failures.append(why)
                    print(f"[run {run}/{args.runs}] {k}/{len(examples)} {'ok  ' if why is None else 'FAIL'} "
                          f"{secs:6.2f}s  {ex.line}" + ("" if why is None else f"\n        {why}"),
                          file=sys.stderr, flush=True)
        with lock:
            pass_seconds.append(time.perf_counter() - t_pass)

    t_all = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one_pass, range(1, args.runs + 1)))
    wall = time.perf_counter() - t_all

    failed = [ex for ex in examples if ex.failures]
    one_pass = statistics.median(pass_seconds)
    rows = table(examples)
    summary = (f"{len(examples)} commands x {args.runs} run{'s' if args.runs > 1 else ''}: "
               f"{len(examples) - len(failed)} passed every run, {len(failed)} failed at least once. "
               f"One pass over the commands: {one_pass:.1f} s (median of {len(pass_seconds)}); "
               f"all {args.runs}: {wall:.1f} s wall clock, {max(1, args.jobs)} pass(es) at a time.")
    print("\n".join(rows))
    print("")
    print(summary)

    if args.write:
        from sections import replace_section  # bench/sections.py, beside this script
        subset = f" (commands containing `{args.only}` and what they depend on)" if args.only else ""
        section = "\n".join([
            HEADING, "",
            f"Every command of README.md's runnable sections (Will my run fit?, Tasks) and of docs/commands.md"
            f"{subset}, "
            f"{args.runs} run"
            f"{'s' if args.runs > 1 else ''} in a row, each run in a fresh temporary directory "
            f"(`python bench/readme_examples.py --runs {args.runs} --jobs {max(1, args.jobs)}"
            f"{' --only ' + shlex.quote(args.only) if args.only else ''} --write`). Machine: {platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}, CUDA {'yes' if has_cuda else 'no'}. "
            "A run passes on the expected exit status with no Traceback on stderr; a failure shows the first "
            "failing run's stderr line.", "",
            *rows, "", summary, ""])
        replace_section(HEADING, section, path=RESULTS)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
