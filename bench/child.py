"""Measure in a fresh process: `run_child(script, spec, timeout)` runs `python script --child <spec as JSON>` and
returns the JSON object the child prints last (its own wall-clock and peak RSS, nothing of the parent's), None when it
runs past `timeout` seconds, or raises with the child's last error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_child(script: str, spec: dict, timeout: float) -> dict | None:
    try:
        p = subprocess.run([sys.executable, os.path.abspath(script), "--child", json.dumps(spec)], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if p.returncode:
        raise RuntimeError(f"{spec}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])
