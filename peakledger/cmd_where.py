"""`peakledger where`: does this scenario fit, and with what micro-batch, on each GPU people train on?

    peakledger where --preset llama-3-8b --lora-r 16 --precision bf16 --micro-batch 1 --seq-len 2048
    peakledger where --hf-config config.json --devices RTX-4090-24GB,A100-80GB --json
    peakledger where --preset gpt2 --check            # exit 1 when it fits on none of the profiles

The same scenario flags as `simulate` (no --device: every GPU profile is the device in turn, or those of
--devices). The logic is peakledger/where.py; this module parses, reports and shows progress on a terminal.
"""

from __future__ import annotations

from .analysis.units import Scale
from .cli_common import add_scenario_flags, decide, write_json
from .inputs import scenario_from_args
from .models.config import ConfigError
from .progress import progress
from .where import GPU_PROFILES, Where, where


def _devices(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ConfigError("devices", f"expected comma-separated GPU profiles, got {text!r}; allowed: "
                                     f"{', '.join(GPU_PROFILES)}")
    return names


def _batch(p) -> str:
    if p.max_micro_batch is None:
        return "fixed" if any(n.startswith("max micro-batch: the module's batch is fixed") for n in p.notes) else "-"
    if p.max_micro_batch < 0:
        return "none"
    return f">= {p.max_micro_batch:,}" if p.search_limit_reached else f"{p.max_micro_batch:,}"


def render(result: Where, unit: str | None) -> str:
    """The table: every size in one unit (`unit`, else the largest value's), named in the first line."""
    g = Scale.of([x for p in result.placements for x in (p.usable, p.allocated_peak, p.reserved_peak,
                                                          p.outside_allocator, p.device_total_peak, p.margin)], unit)
    f = g.number
    head = (f"{result.scenario}: micro-batch {result.micro_batch}, {result.precision}, torch {result.torch_version} "
            "CUDA rules" + (f", headroom {result.headroom:g}" if result.headroom else "")
            + (f"; {result.world_size} GPUs, each row one GPU (the worst rank)" if result.world_size > 1 else "")
            + f"; sizes in {g.unit}")
    cols = ("device", "usable", "allocated", "reserved", "outside", "device total", "fits", "margin", "max mb")
    rows = []
    for p in result.placements:
        rows.append((p.device, f(p.usable), f(p.allocated_peak), f(p.reserved_peak), f(p.outside_allocator),
                     f(p.device_total_peak),
                     ("yes" if p.fits else "no") + (" (flush)" if p.by_retry else "") + ("" if p.exact else "*"),
                     ("+" if p.margin >= 0 else "") + f(p.margin), _batch(p)))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [head, "", line(cols)] + [line(r) for r in rows]
    fits = result.fits_on
    out += ["", f"fits on {len(fits)} of {len(result.placements)}: {', '.join(fits)}" if fits
            else f"fits on none of the {len(result.placements)} profiles"]
    notes = [(p.device, n) for p in result.placements for n in p.notes]
    if notes:
        out += ["notes" + ("" if all(p.exact for p in result.placements) else " (*: that row simulates another GPU's "
                           "attention kernel, not exact)") + ":"] + [f"  {d}: {n}" for d, n in notes]
    out += ["", "usable: the total the CUDA driver reports (cudaMemGetInfo; bench/SOURCES.md); outside: CUDA context "
            "and kernels (+ NCCL's buffers) outside the caching allocator; device total = outside + reserved; "
            "margin = usable - device total x (1 + headroom); fits (flush): only because the allocator frees its "
            "cache and retries, the row the run on this card; max mb: the largest micro-batch that fits (-: not "
            "searched; 0: the parameters, gradients and optimizer states do, not one sample; none: not even they)"]
    return "\n".join(out)


def cmd_where(args) -> int:
    if args.device is not None:
        raise ConfigError("device", "where simulates on every GPU profile in turn; choose some with --devices "
                                    f"(allowed: {', '.join(GPU_PROFILES)})")
    devices = _devices(args.devices)
    scenario = scenario_from_args(args)
    with progress("simulating on each GPU profile", total=len(devices or GPU_PROFILES)) as bar:
        result = where(scenario, devices, search=not args.no_max_batch,
                       progress=lambda i, n, name: bar.advance(0 if i == 0 else 1, f"simulating on {name}"))
    code = decide(args, 1 if args.check and not result.fits_on else 0)
    if args.json:
        write_json(result.as_json())
    else:
        print(render(result, args.unit))
    return code


def register(sub) -> None:
    """Adds the `where` sub-command: the scenario on every GPU device profile."""
    w = sub.add_parser("where", help="on which GPUs the scenario fits, and the largest micro-batch on each")
    add_scenario_flags(w)
    w.add_argument("--devices", metavar="NAME,NAME", help="GPU profiles to try (default: all): "
                                                          + ", ".join(GPU_PROFILES))
    w.add_argument("--no-max-batch", action="store_true",
                   help="skip the largest-micro-batch search (fit at the given micro-batch only)")
    w.add_argument("--check", action="store_true", help="exit 1 when the scenario fits on none of the profiles")
    w.add_argument("--json", action="store_true", help="print one JSON object (bytes)")
    w.set_defaults(func=cmd_where)
