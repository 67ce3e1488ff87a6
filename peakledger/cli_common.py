"""What every `peakledger` command shares: the scenario flags (model, training, run), sizes given as flags, the
`--case` syntax, and JSON output. peakledger/cli.py builds the commands from these; the command modules
(cmd_explain.py, cmd_calibrate.py) use them too."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from . import api
from .analysis.card_fit import THIN_MARGIN, CardFit
from .analysis.host import HostFit, HostLimits, judge_host
from .analysis.peaks import with_headroom
from .analysis.units import format_bytes, parse_bytes
from .inputs import MODEL_FLAG_TYPES
from .models.config import FLAG_GROUPS, SETUP_KNOBS, ConfigError
from .models.devices import DEVICES, device_profile
from .models.presets import PRESETS
from .scenario import parse_value
from .simulator.numbers import float_text, int_text, non_ascii_digit


class _Once:
    """A flag that takes one value refuses a second (`--budget 1GiB --budget 1MiB`, or a switch and its `--no-`
    twin): argparse would keep the last silently. Mixed into argparse's own store actions; repeatable flags are
    declared `action="append"`."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault(GIVEN, {})
        if option_string is not None and self.dest in given:
            first = given[self.dest]
            parser.error(f"{option_string} is given twice" if first == option_string else
                         f"{option_string} and {first} both set {self.dest}: give one")
        if option_string is not None:
            given[self.dest] = option_string
        super().__call__(parser, namespace, values, option_string)


GIVEN = "_flags_given"  # the namespace's record of the flags given, by destination
ONCE_ACTIONS = {name: type(f"Once{base.__name__}", (_Once, base), {}) for name, base in (
    ("store", argparse._StoreAction), ("store_const", argparse._StoreConstAction),
    ("store_true", argparse._StoreTrueAction), ("store_false", argparse._StoreFalseAction))}


def decide(args, code: int) -> int:
    """A command's exit status, settled before it writes its output: a reader that goes away (`| head -1`) ends
    the output, never the verdict (cli.main returns it on a closed pipe)."""
    args.exit_code = code
    return code


def add_scenario_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--scenario", help="TOML scenario file ([model], [training], [run]); flags override it")
    g.add_argument("--preset", metavar="NAME", help=f"a model by name: a hand-written preset ({', '.join(PRESETS)}; "
                   "default gpt2), or a current open model's bundled config.json by name or hub id (qwen2.5-7b, "
                   "Qwen/Qwen2.5-7B: `peakledger models` lists them), or a hub id in the local hub cache")
    g.add_argument("--hf-config", help="a HF transformers config.json (any model type transformers builds), or a "
                   "bundled model's name or hub id as --preset takes it")
    g.add_argument("--module", metavar="FILE.py:FACTORY",
                   help="your own model: FACTORY() returns (model, batch, loss_fn); traced on fake tensors")
    g.add_argument("--describer", help="auto (default), traced, hand-written: how --hf-config is described")
    for name, kind in MODEL_FLAG_TYPES:
        g.add_argument("--" + name.replace("_", "-"), type=VALUE_TYPES[kind], dest=f"model_{name}",
                       help=argparse.SUPPRESS)
    add_setup_flags(p)
    r = p.add_argument_group("run")
    r.add_argument("--device", help=", ".join(DEVICES))
    r.add_argument("--headroom", type=flag_float, help="a margin judged with the run: capacity needed = peak x "
                   "(1 + headroom); 0.1 = 10%%; default 0 (a fit by the allocator's flush-and-retry is then allowed, "
                   "and said)")
    r.add_argument("--alloc-conf", metavar="CONF", help="CUDA caching allocator settings on GPU device profiles, in "
                   "PYTORCH_CUDA_ALLOC_CONF syntax, e.g. expandable_segments:True,max_split_size_mb:128")
    r.add_argument("--empty-cache-before-save", action="store_true", default=None,
                   help="the program calls torch.cuda.empty_cache() before each checkpoint save (GPU profiles)")
    r.add_argument("--torch-version", help="whose CUDA rules apply (caching allocator, kernels, workspaces): 2.6, 2.11 "
                   "or 2.13; default: the installed torch's, else the nearest modelled")
    r.add_argument("--simulator", help="the discrete-event engine: builtin (default) or simpy (SimPy's own objects: "
                   "the same events, slower; simulator/simpy_engine.py takes processes of your own)")
    r.add_argument("--unit", choices=["GiB", "GB", "MiB", "MB"],
                   help="print every table's sizes in this unit (default: each table's own, from its largest "
                   "value; a size in a sentence in GiB); --json always gives bytes")
    r.add_argument("--debug", action="store_true", help="on an internal error, print the whole traceback")
    r.add_argument("--module-timeout", type=flag_float, metavar="SECONDS",
                   help="--module: the longest its import, factory or traced step may run (default 600; 0: no limit)")
    r.add_argument("--no-cache", action="store_true", help="--hf-config: trace anew, neither reading nor writing the "
                   "disk cache of traces ($PEAKLEDGER_CACHE_DIR, default ~/.cache/peakledger/traces; docs/models.md)")


def _typed(read, kind: str):
    """An argparse type reading ASCII numbers only (simulator/numbers.py): `--micro-batch ๓` is refused, not 3."""
    def convert(text: str):
        value = read(text)
        if value is None:
            odd = non_ascii_digit(text)
            raise argparse.ArgumentTypeError(f"invalid {kind} value: {text!r}" + (
                f" ({odd!r} is not one of the digits 0-9)" if odd else ""))
        return value
    convert.__name__ = kind
    return convert


flag_int = _typed(int_text, "int")
flag_float = _typed(float_text, "float")


def _comma_ints(text: str) -> tuple[int, ...]:
    values = tuple(int_text(x) for x in text.split(",") if x.strip())
    if any(v is None for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 0,3,7), got {text!r}")
    return values


def _comma_strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(","))


VALUE_TYPES = {int: flag_int, float: flag_float, str: str, str | None: str, tuple[int, ...]: _comma_ints,
               tuple[str, ...]: _comma_strs}


def add_setup_flags(p: argparse.ArgumentParser) -> None:
    """One group of flags per section of the training setup, generated from its knobs (models/config/knobs.py):
    --name VALUE typed by the field, --name for a switch that is off by default, --no-name for one that is on,
    a repeated flag for a list of patterns. Every flag defaults to None: only what the user gives is set."""
    groups = {group: p.add_argument_group(title) for group, title in FLAG_GROUPS.items()}
    for k in SETUP_KNOBS:
        how, group = k.knob, groups[k.knob.group]
        extra = {"help": argparse.SUPPRESS if how.hidden else (how.text or None), "dest": k.name}
        if how.metavar:
            extra["metavar"] = how.metavar
        if how.cli == "none":
            continue
        if how.cli in ("on", "off"):
            group.add_argument(k.flag, action="store_true" if how.cli == "on" else "store_false", default=None,
                               **extra)
        elif how.cli == "append":
            group.add_argument(k.flag, action="append", **extra)
        else:
            group.add_argument(k.flag, type=VALUE_TYPES[k.annotation],
                               **({"choices": how.choices} if how.argparse_choices else {}), **extra)


def budget_flag(args, name: str = "budget") -> int | None:
    """A size flag as bytes (None when not given; an empty value is an error, never "no budget")."""
    value = getattr(args, name, None)
    return None if value is None else parse_bytes(value, name)


def budget_of(args, scenario, needed_by: str) -> int:
    """The budget a command checks against: --budget, or else the device profile's memory (a GPU profile is a
    card of that size); a ConfigError naming `needed_by` when neither gives one (the cpu profile without
    --budget)."""
    given = budget_flag(args)
    if given is not None:
        return given
    profile = device_profile(scenario.device)
    if profile.is_cpu:
        raise ConfigError("budget", f"{needed_by} needs a budget: give --budget (e.g. 24GiB; the cpu profile has no "
                                    "memory size of its own) or a GPU --device, whose memory is the budget")
    return profile.memory_bytes


def add_check_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help="a fit check for scripts: exit 1 when the run does not fit the budget (--budget, or else the "
                        "--device profile's memory), 0 when it fits; the last line says which")


def add_host_flags(p: argparse.ArgumentParser) -> None:
    """The host's limits (analysis/host.py): judged with the device by --check, where and explain."""
    g = p.add_argument_group("host memory (judged per node: the ranks of a node share its RAM)")
    g.add_argument("--host-memory", help="host RAM per node (2TiB, 512GiB): judged when given, or by default where "
                   "the --device profile has a typical node (H100-80GB, H200-141GB: DGX, 2 TiB) and the run puts "
                   "tensors on the host")
    g.add_argument("--pinned-limit", help="pinned (page-locked) host memory per node (default: half of "
                   "--host-memory, analysis/host.py)")
    g.add_argument("--gpus-per-node", type=flag_int, help="ranks per node sharing one host (default: the profile's "
                   "node, 8, or the world size if smaller)")


def host_limits(args) -> HostLimits:
    """The host flags as limits (analysis/host.py); bad values: ConfigError naming the flag."""
    per_node = getattr(args, "gpus_per_node", None)
    if per_node is not None and per_node < 1:
        raise ConfigError("gpus_per_node", f"must be >= 1, got {per_node}")
    return HostLimits(budget_flag(args, "host_memory"), budget_flag(args, "pinned_limit"), per_node)


def host_verdict(args, scenario, log, index=None) -> HostFit | None:
    """The host's verdict of the run in `log` under the host flags (analysis/host.py `judge_host`); None: not
    judged. `index`: the log's (a report's `index`, simulator/log_index.py)."""
    return judge_host(log, scenario.device, host_limits(args), index)


def host_json(args, host: HostFit | None) -> dict:
    """{"host_check": ...} where the host was judged on request (--host-memory or --pinned-limit) or does not fit;
    else {} (a run judged only by a profile's default node, and fitting it, keeps its JSON as it was)."""
    return {"host_check": host.as_json()} if host is not None and (host.asked or not host.fits) else {}


def check_line(fits: bool, need: int, budget: int, unit: str) -> str:
    """The last line of a --check: FITS with the margin, or DOES NOT FIT with how far over."""
    f = lambda n: format_bytes(n, unit)  # noqa: E731
    return (f"fit check: FITS ({f(need)} of {f(budget)}, margin {f(budget - need)})" if fits else
            f"fit check: DOES NOT FIT ({f(need)} needed of {f(budget)}: over by {f(need - budget)})")


@dataclass(frozen=True)
class FitVerdict:
    """A --check's answer: the run's one verdict against the budget (analysis/card_fit.py `CardFit`: the need
    judged, a fit only by the caching allocator's flush-and-retry, a thin margin), or, for a run that stopped at
    its first OOM (`stopped_at`, the op), a lower bound of the need (what was live there plus the allocation that
    failed, x (1 + headroom)): such a run never fits. `host`, where the host is judged (analysis/host.py): the run
    fits only when the device and the host both do."""

    fits: bool
    need: int
    budget: int
    stopped_at: str | None = None
    card: CardFit | None = None
    host: HostFit | None = None
    device_fits: bool | None = None  # with `host`: the device's verdict alone

    @property
    def fits_gpu(self) -> bool:
        return self.fits if self.device_fits is None else self.device_fits

    @property
    def shows_host(self) -> bool:
        """The host's verdict is said (line, JSON) where it was asked for or does not fit: a run judged only by its
        profile's default node, and fitting it, reads as before."""
        return self.host is not None and (self.host.asked or not self.host.fits)

    @property
    def by_retry(self) -> bool:
        return self.card is not None and self.card.by_retry

    def line(self, unit: str) -> str:
        f = lambda n: format_bytes(n, unit)  # noqa: E731
        if self.stopped_at is not None:
            return (f"fit check: DOES NOT FIT (the run stopped at its first OOM, at {self.stopped_at}: at least "
                    f"{f(self.need)} needed of {f(self.budget)}, over by at least {f(self.need - self.budget)})")
        text = check_line(self.fits_gpu, self.need, self.budget, unit)
        if self.host is not None and self.fits_gpu and not self.host.fits:  # the device fits, the host does not
            text = "fit check: DOES NOT FIT: fits the GPU" + text.removeprefix("fit check: FITS")
        if self.by_retry:
            text += (f"; only because the caching allocator frees its cache and retries ({self.card.alloc_retries:,} "
                     f"request(s) after a flush, torch's rule): unbounded it would hold {f(self.card.unbounded)}")
        if self.card is not None and self.card.thin:
            text += f"; thin margin, under {THIN_MARGIN:.0%} of the budget (--headroom adds a margin to what is judged)"
        if self.shows_host:
            text += "; " + self.host.text(unit)
        return text

    def as_json(self) -> dict:
        card = self.card
        return {"budget": self.budget, "fits": self.fits, "capacity_needed": self.need,
                "capacity_needed_is_lower_bound": self.stopped_at is not None, "stopped_at_oom": self.stopped_at,
                "fits_by_allocator_retry": self.by_retry, "alloc_retries": card.alloc_retries if card else 0,
                "unbounded_capacity_needed": card.unbounded if card else None,
                "thin_margin": bool(card and card.thin),
                **({"fits_gpu": self.fits_gpu, "host": self.host.as_json()} if self.shows_host else {})}


def fit_verdict(report, budget: int, headroom: float, host: HostFit | None = None) -> FitVerdict:
    """The --check verdict of `report` against `budget` and, given `host` (`host_verdict`), the host's limits (see
    FitVerdict); never read from a partial run."""
    log = report.log
    if log.metadata.stopped_at_oom and log.ooms:
        oom = log.ooms[0]
        need = with_headroom(oom.live_bytes + oom.event.block.nbytes, headroom)
        return FitVerdict(False, max(need, budget + 1), budget, stopped_at=oom.event.op, host=host)
    card = api.card_fit(report, budget)
    gpu = card.fits and not log.ooms
    return FitVerdict(gpu and (host is None or host.fits), card.need, budget, card=card, host=host,
                      device_fits=gpu if host is not None else None)


def parse_case(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ConfigError("case", f"expected 'name: key=value ...', got {text!r}")
    changes = {}
    for item in rest.split():
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError("case", f"expected key=value in {text!r}, got {item!r}")
        if key == "name":
            raise ConfigError("case", f"the case's name is the text before ':' in {text!r}; 'name' is not a field "
                                      "to change")
        if key in changes:
            raise ConfigError("case", f"{key} is given twice in {text!r}")
        changes[key] = parse_value(value)
    return name.strip(), changes


def table_lines(cols, rows) -> list[str]:
    """A text table: the first column left-aligned, the others right-aligned, each as wide as its widest cell."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(cols)] + [line(r) for r in rows]


def write_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
