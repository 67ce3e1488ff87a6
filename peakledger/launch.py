"""The `peakledger` command's first step: hand the command to this installation's server where one is up
(peakledger/serve), else run it in this process (cli.entry). `peakledger serve` itself runs here: the server, and
in each fork it makes for a command, that command.

Nothing heavy is imported before the server has been asked: the package's own `__init__` imports lazily, so a
command the server runs costs this process a Python start and a socket.
"""

from __future__ import annotations

import sys


def entry() -> None:
    """The `peakledger` console script."""
    argv = sys.argv[1:]
    if argv[:1] != ["serve"]:
        from .serve.client import forward

        code = forward(argv)
        if code is not None:
            sys.stdout.flush()
            sys.exit(code)
    from . import cli

    if argv[:1] == ["serve"]:
        from .serve.server import serve

        try:
            options = cli.build_parser().parse_args(argv)  # (its errors: one line, exit 2)
        except SystemExit as e:
            sys.exit(e.code)
        outcome = serve(options, argv[1:])
        if isinstance(outcome, int):
            sys.exit(outcome)
        argv = outcome.argv  # in the server's fork for a command: run it
    cli.entry(argv)


if __name__ == "__main__":
    entry()
