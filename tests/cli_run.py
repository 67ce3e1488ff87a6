"""The CLI run in-process, as tests read it: `cli(*argv)` -> (exit status, stdout, stderr); `cli_json(*argv)` adds
--json, asserts exit 0 and parses stdout."""

from __future__ import annotations

import contextlib
import io
import json

from peakledger.cli import main


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def cli_json(*argv) -> dict:
    rc, out, err = cli(*argv, "--json")
    assert rc == 0, err
    return json.loads(out)
