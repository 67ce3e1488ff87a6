"""`peakledger serve`: in the parser for its help and its flags' checks; it runs in peakledger/launch.py (the
server forks itself for each command and returns the command there, which a `main()` called inside another program
cannot do)."""

from __future__ import annotations

import sys

from .serve.protocol import add_arguments


def cmd_serve(args) -> int:
    print("peakledger: error: `serve` runs as the peakledger command (peakledger.launch), not through "
          "peakledger.cli.main", file=sys.stderr)
    return 2


def register(sub) -> None:
    """Adds the `serve` sub-command (its help)."""
    p = sub.add_parser("serve", help="a resident peakledger: imports torch and transformers once, then runs each "
                                     "`peakledger` command of this installation in a fork of itself")
    add_arguments(p)
    p.set_defaults(func=cmd_serve, unit=None)
