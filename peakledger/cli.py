"""The `peakledger` command: its parser, made of the commands' own registrations, and `main`.

    peakledger simulate [--preset gpt2 | --hf-config config.json | --scenario file.toml] [flags] [--json] [--plot F]
    peakledger max-batch --budget 80GiB [same model/training flags]
    peakledger compare [--case "name: key=value key=value" ...] [same flags for the base scenario]
    peakledger validate | capture | explain | replay | calibrate ...
    peakledger models                    # the models --preset takes by name
    peakledger plan --compute 1e21 --params 125M,1B,7B   # a training budget: C = 6ND, tokens per size, hours

Each command module registers its sub-commands (`register(subparsers)`) and holds what they run: cmd_simulate.py
(simulate, max-batch, compare, checkpointing, sweep), cmd_validate.py (validate, capture), cmd_explain.py (explain,
replay), cmd_calibrate.py (calibrate fit / apply); their shared flags are cli_common.py's. A new command is one
module with `register` and one entry in `COMMANDS`.

Bad input exits 2 with one line naming the field and the allowed values.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
import traceback

from . import (
    cmd_calibrate,
    cmd_explain,
    cmd_ledger,
    cmd_models,
    cmd_plan,
    cmd_run,
    cmd_serve,
    cmd_simulate,
    cmd_validate,
    cmd_where,
)
from .cli_common import ONCE_ACTIONS
from .inputs import check_common
from .kept import keeping
from .models.names import did_you_mean
from .models.traced.boundary import end_user_processes, time_limit
from .models.traced.store import cache_enabled
from .simulator.safe_io import InputError, all_or_none, digits_message, too_many_digits


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching (`--micro 3` is not `--micro-batch 3`; `sweep --json` is not
    `--json-output`), a single-valued flag given twice refused (`_Once`), its errors in the CLI's one-line form
    with exit 2 (subcommands' parsers are of this class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.all_flags: frozenset[str] = frozenset()  # the top parser's: every command's long flags
        for name, action in ONCE_ACTIONS.items():
            self.register("action", name, action)
        self.register("action", None, ONCE_ACTIONS["store"])

    def _check_value(self, action, value) -> None:
        """argparse's refusal of a value not among a flag's choices, with the closest one suggested."""
        if action.choices is not None and value not in action.choices:
            flag = "/".join(action.option_strings) or action.dest
            allowed = ", ".join(map(repr, action.choices))
            self.error(f"argument {flag}: invalid choice: {value!r} (choose from {allowed})"
                       + did_you_mean(value, [str(c) for c in action.choices]))

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):  # a flag misspelt: the closest flag of any command
            unknown = [w.split("=")[0] for w in message.split(": ", 1)[1].split() if w.startswith("-")]
            if unknown:
                message += did_you_mean(unknown[0], sorted(self.all_flags))
        self.exit(2, f"peakledger: error: {message} (see {self.prog} --help)\n")


# each: register(subparsers)
COMMANDS = (cmd_simulate, cmd_run, cmd_where, cmd_validate, cmd_explain, cmd_ledger, cmd_calibrate, cmd_models,
            cmd_plan, cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="peakledger", description="Where the memory of a training step goes.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    parser.all_flags = frozenset(flag for p in sub.choices.values() for flag in p._option_string_actions
                                 if flag.startswith("--"))
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python runs next so every `finally` (temporary files, worker pools) runs."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _internal_error(args, e: BaseException) -> int:
    if getattr(args, "debug", False):
        traceback.print_exc()
    print(f"peakledger: internal error (a bug in peakledger, not your input): {type(e).__name__}: {e}"
          + ("" if getattr(args, "debug", False) else "; run again with --debug for the traceback"), file=sys.stderr)
    return 3


def _silence_stdout() -> None:
    """stdout's reader has gone: what Python still holds for it goes to /dev/null, so the flush at exit neither
    raises nor turns the exit status into 120 (docs.python.org/3/library/signal.html, note on SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # (a stdout without a file descriptor: a test's capture)
        pass


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success (1: a validate outside its tolerance), 2 on bad input (one line naming it), 3 on an
    internal error (a bug: one line, the traceback with --debug), 130 / 143 when interrupted / terminated."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []
    if argv[:1] == ["run"] and "--" in argv:  # `run SCRIPT.py [flags] -- ARGS`: ARGS are the script's, untouched
        cut = argv.index("--")
        argv, passed = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(argv)
        if args.command == "run":
            args.script_args = passed
    except SystemExit as e:  # argparse's error (one line, `Parser.error`) or --help: its status, not a raise
        return e.code if isinstance(e.code, int) else 2
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        check_common(args)
        with time_limit(getattr(args, "module_timeout", None)), all_or_none(), \
                cache_enabled(not getattr(args, "no_cache", False)):  # (the outputs: all or none)
            try:
                return args.func(args)
            except BrokenPipeError:  # stdout's reader went away (| head): the outputs stand, and the verdict
                _silence_stdout()
                return getattr(args, "exit_code", 0)
    except InputError as e:
        print(f"peakledger: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"peakledger: {'terminated' if isinstance(e, _Terminated) else 'interrupted'}: nothing written",
              file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    except ValueError as e:
        if not too_many_digits(e):
            return _internal_error(args, e)
        print(f"peakledger: error: {digits_message('an input')}", file=sys.stderr)  # (a reader that does not say)
        return 2
    except Exception as e:  # the one place an unexpected error becomes a message
        return _internal_error(args, e)
    finally:
        end_user_processes()  # what a --module's code started ends with the command (models/traced/processes.py)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def entry(argv: list[str] | None = None) -> None:
    """The `peakledger` command: `main()`, then the exit without the interpreter's teardown. Freeing every object of
    torch and transformers one by one at exit took 0.5-1.8 s of a 5-7 s traced command, after its answer was
    printed. The exit functions still run (atexit: logging's flush, multiprocessing's children, weakref finalizers)
    and stdout and stderr are flushed, then the process exits with main()'s status (os._exit); where a thread
    other than daemons still runs (a user's script started it), the ordinary exit, which waits for it."""
    keeping()  # what a command made is not freed one by one either (peakledger/kept.py)
    code = main(argv)
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # (stdout's reader went away: as main() does)
            _silence_stdout()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
