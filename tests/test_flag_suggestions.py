"""'Did you mean' on what argparse itself refuses (a flag's choices, an unknown flag) and on where's layouts: the same
one-line refusal, exit 2, with the closest allowed name (models/names.py)."""

from __future__ import annotations

import contextlib
import io

import pytest

from peakledger.cli import main


@pytest.mark.parametrize("argv, says", [
    (["simulate", "--preset", "tiny", "--loop", "hf"],
     "argument --loop: invalid choice: 'hf' (choose from 'plain', 'hf-trainer'); did you mean 'hf-trainer'?"),
    (["simulate", "--preset", "tiny", "--unit", "gib"], "invalid choice: 'gib'"),
    (["simulate", "--preset", "tiny", "--micro_batch", "2"],
     "unrecognized arguments: --micro_batch 2; did you mean '--micro-batch'?"),
    (["where", "--preset", "tiny", "--min-gpus", "--layouts", "fsdp"],
     "layouts: 'fsdp' is not a layout; allowed: fsdp2, zero3, tp; did you mean 'fsdp2'?"),
    (["where", "--preset", "tiny", "--min-gpus", "--layouts", "deepspeed"], "did you mean 'zero3'?"),
])
def test_refusals_suggest_the_closest_name(argv, says):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    assert rc == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and out.getvalue() == ""
    if "--unit" in argv:
        assert "did you mean 'GiB'?" in lines[0]
