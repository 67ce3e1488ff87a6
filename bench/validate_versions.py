"""The program is also the library versions the user has: Gemma2 and T5 traced under transformers 5.17 and under the
newest supported release, each against a real CPU run of that same version.

transformers 5.25 runs Gemma2 with eager attention and T5 with SDPA, 5.17 the reverse (issue 35); a trace of one
version is the program of that version only. For each version this runs `peakledger validate --hf-config` in a
venv that has that version installed (the traced describer and the real CPU run under the tracker, both in that
venv), and then holds the newest version's prediction against the older version's real run, the mistake of
predicting a user's 5.17 environment from a 5.25 install.

    python bench/validate_versions.py                       # makes /tmp/peakledger-tf517 the first time (pip, ~1 min)
    python bench/validate_versions.py --write               # also replace the section in bench/VALIDATION.md

The other version's venv: a fresh venv whose .pth adds this venv's site-packages (torch and the rest as they are
here), transformers==5.17.0 installed into it (with the dependencies it needs that differ), and this checkout
installed into it, not editable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from sections import replace_section  # noqa: E402  (bench/sections.py, beside this script)

HEADING = "## Library versions: the traced program is the installed one"
OLD = "5.17.0"
MODELS = {"gemma2": "examples/hf-gemma2-tiny/config.json", "t5": "examples/hf-t5-tiny/config.json"}
FLAGS = ["--micro-batch", "2", "--seq-len", "64", "--precision", "fp32"]


def make_venv(path: str, version: str) -> str:
    python = os.path.join(path, "bin", "python")
    if os.path.exists(python):
        return python
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "peakledger_base.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"transformers=={version}", "setuptools", "wheel"], check=True)
    subprocess.run(pip + ["--no-deps", "--no-build-isolation", ROOT], check=True)
    return python


def validate(python: str, config: str) -> dict:
    command = os.path.join(os.path.dirname(python), "peakledger")  # (not -m from here: this checkout is not installed)
    done = subprocess.run([command, "validate", "--hf-config", config, *FLAGS, "--json"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{python} validate {config}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
    out = json.loads(done.stdout)
    version = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return {"version": version, "measured": out["peak"]["measured"], "predicted": out["peak"]["predicted"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default="/tmp/peakledger-tf517", help=f"the venv with transformers {OLD}")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    old = make_venv(a.venv, OLD)
    rows = []
    for name, config in MODELS.items():
        by = {"old": validate(old, config), "new": validate(sys.executable, config)}
        for side in ("old", "new"):
            r = by[side]
            rows.append((name, f"transformers {r['version']}", f"its own real run ({r['version']})", r["measured"],
                         r["predicted"]))
        rows.append((name, f"transformers {by['new']['version']}", f"a real run of {by['old']['version']}",
                     by["old"]["measured"], by["new"]["predicted"]))
    lines = ["| model | traced with | held against | measured peak (B) | predicted peak (B) | error |",
             "|---|---|---|---:|---:|---:|"]
    for name, traced, against, m, s in rows:
        lines.append(f"| {name} | {traced} | {against} | {m:,} | {s:,} | {(s - m) / m:+.3%} |")
    text = "\n".join(lines)
    print(text)
    if a.write:
        replace_section(HEADING, "\n".join([
            HEADING, "",
            "`python bench/validate_versions.py --write`: `peakledger validate --hf-config CONFIG "
            f"{' '.join(FLAGS)}` in two venvs, one with transformers {OLD}, one with the newest release peakledger "
            "supports (torch 2.13 CPU in both). Each version's trace is held against a real CPU run of the same "
            "version (the tracker), then the newest version's trace against the old version's run: what a user "
            "with the old version would be told if peakledger traced a version they do not run. The report names "
            "the version it traced (`described by: traced (...; torch ..., transformers ...)`).", "", text, ""]))


if __name__ == "__main__":
    main()
