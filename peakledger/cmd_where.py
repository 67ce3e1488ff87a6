"""`peakledger where`: does this scenario fit, and with what micro-batch, on each GPU people train on?

    peakledger where --preset llama-3-8b --lora-r 16 --precision bf16 --micro-batch 1 --seq-len 2048
    peakledger where --hf-config config.json --devices RTX-4090-24GB,A100-80GB --json
    peakledger where --preset gpt2 --check            # exit 1 when it fits on none of the profiles
    peakledger where --preset llama-3-8b --micro-batch 4 --seq-len 2048 --devices H100-80GB --min-gpus

The same scenario flags as `simulate` (no --device: every GPU profile is the device in turn, or those of
--devices). The logic is peakledger/where.py; this module parses, reports and shows progress on a terminal.
"""

from __future__ import annotations

from .analysis.host import HostLimits
from .analysis.units import Scale, format_bytes
from .assumed import assumed, assumed_lines
from .cli_common import add_host_flags, add_scenario_flags, decide, host_limits, table_lines, write_json
from .gpus import GPU_LIMIT, LAYOUTS
from .inputs import scenario_from_args
from .models.config import ConfigError
from .progress import progress
from .where import GPU_PROFILES, CardCounts, Where, min_gpus_per_card, where

EACH_CARD = "each card of the table in turn"


def _names(text: str | None, flag: str, noun: str, allowed) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ConfigError(flag, f"expected comma-separated {noun}, got {text!r}; allowed: {', '.join(allowed)}")
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
                                                          p.outside_allocator, p.device_total_peak, p.margin)
                  if x is not None], unit)

    def f(x: int | None) -> str:
        return "-" if x is None else g.number(x)  # (a refused row has no sizes)
    head = (f"{result.scenario}: micro-batch {result.micro_batch}, {result.precision}, torch {result.torch_version} "
            "CUDA rules" + (f", headroom {result.headroom:g}" if result.headroom else "")
            + (f"; {result.world_size} GPUs, each row one GPU (the worst rank)" if result.world_size > 1 else "")
            + f"; sizes in {g.unit}")
    cols = ("device", "usable", "allocated", "reserved", "outside", "device total", "fits", "margin", "max mb")
    rows = []
    for p in result.placements:
        rows.append((p.device, f(p.usable), f(p.allocated_peak), f(p.reserved_peak), f(p.outside_allocator),
                     f(p.device_total_peak),
                     ("yes" if p.fits else "no") + (" (host)" if p.host_fails else "")
                     + (" (refused)" if p.refused is not None else "")
                     + (" (flush)" if p.by_retry else "") + ("" if p.exact else "*"),
                     ("+" if p.margin is not None and p.margin >= 0 else "") + f(p.margin), _batch(p)))
    out = [head, "", *table_lines(cols, rows)]
    fits = result.fits_on
    out += ["", f"fits on {len(fits)} of {len(result.placements)}: {', '.join(fits)}" if fits
            else f"fits on none of the {len(result.placements)} profiles"]
    notes = [(p.device, n) for p in result.placements for n in p.notes]
    if notes:
        out += ["notes" + ("" if all(p.exact for p in result.placements) else " (*: that row simulates another GPU's "
                           "attention kernel, not exact)") + ":"] + [f"  {d}: {n}" for d, n in notes]
    rl = [line for p in result.placements if p.rl is not None for line in p.rl.lines(p.device)]
    if rl:
        out += ["RL (each figure re-simulated on the card; max mb: the largest micro-batch TRL accepts, "
                "num_generations dividing micro-batch x grad_accum, that fits):"] + [f"  {line}" for line in rl]
    out += ["", "usable: the total the CUDA driver reports (cudaMemGetInfo; bench/SOURCES.md); outside: CUDA context "
            "and kernels (+ NCCL's buffers) outside the caching allocator; device total = outside + reserved; "
            "margin = usable - device total x (1 + headroom); fits no (host): the GPU fits, the node's host does not "
            "(notes); fits no (refused): the run stops before its first step on this card (a colocated vLLM engine "
            "refuses to start: notes), no sizes; fits (flush): only because the allocator frees its "
            "cache and retries, the row the run on this card; max mb: the largest micro-batch that fits (-: not "
            "searched; 0: the parameters, gradients and optimizer states do, not one sample; none: not even they)"]
    return "\n".join(out)


def cmd_where(args) -> int:
    if args.device is not None:
        raise ConfigError("device", "where simulates on every GPU profile in turn; choose some with --devices "
                                    f"(allowed: {', '.join(GPU_PROFILES)})")
    devices = _names(args.devices, "devices", "GPU profiles", GPU_PROFILES)
    layouts = _names(args.layouts, "layouts", "layouts", [lay.key for lay in LAYOUTS])
    if args.max_gpus is not None and not 1 <= args.max_gpus <= GPU_LIMIT:
        raise ConfigError("max_gpus", f"must be 1 to {GPU_LIMIT}, got {args.max_gpus}")
    if (layouts is not None or args.max_gpus is not None) and not args.min_gpus:
        raise ConfigError("layouts" if layouts is not None else "max_gpus", "only goes with --min-gpus")
    scenario = scenario_from_args(args)
    limits = host_limits(args)
    if args.min_gpus and limits != HostLimits():
        raise ConfigError("host_memory", "the host flags go with where's table, not --min-gpus (each count there is "
                                         "judged with the profile's typical node)")
    if args.min_gpus:
        return _cmd_min_gpus(args, scenario, devices, layouts)
    with progress("simulating on each GPU profile", total=len(devices or GPU_PROFILES)) as bar:
        result = where(scenario, devices, search=not args.no_max_batch,
                       progress=lambda i, n, name: bar.advance(0 if i == 0 else 1, f"simulating on {name}"),
                       host=limits)
    code = decide(args, 1 if args.check and not result.fits_on else 0)
    if args.json:
        write_json({**result.as_json(), "assumed": assumed(scenario, devices=EACH_CARD)})
    else:
        print("\n".join([render(result, args.unit), "", *assumed_lines(scenario, devices=EACH_CARD)]))
    return code


def render_counts(scenario_name: str, cards: list[CardCounts], unit: str) -> str:
    """The smallest GPU count per card and layout, each checked at that count and at the one below."""
    f = lambda n: format_bytes(abs(n), unit)  # noqa: E731
    layouts = [c.layout for c in cards[0].counts] if cards else []
    head = (f"{scenario_name}: the fewest GPUs of each card that fit it, per layout (the same micro-batch per GPU; "
            "each count simulated, and the one below it)")
    def cell(c) -> str:
        if c.n is None:
            return "refused" if c.error else f"none <= {c.limit:,}"
        return f"{c.n:,}" + (" (flush)" if c.at.by_retry else "")
    cols = ("device", *(lay.name for lay in layouts))
    rows = [(card.device, *(cell(c) for c in card.counts)) for card in cards]
    out = [head, "", *table_lines(cols, rows), "", "checked:"]
    for card in cards:
        for c in card.counts:
            if c.n is None:
                why = f"refused ({c.error})" if c.error else f"no count up to {c.limit:,} GPUs fits"
                if not c.error and c.below is not None:
                    why += (f": at {c.below_n:,} still short {f(c.below.margin)}, what each GPU holds unsharded (the "
                            "activations of its micro-batch, buffers, the CUDA context); add --checkpointing or a "
                            "smaller --micro-batch")
                out.append(f"  {card.device}, {c.layout.name}: {why}")
                continue
            text = f"  {card.device}, {c.layout.name}: {c.n:,} GPU(s) fit with {f(c.at.margin)} to spare"
            if c.below is not None:
                text += f"; {c.below_n:,} do not: short {f(c.below.margin)}"
            elif c.below_n is not None:
                text += f"; {c.below_n:,}: refused by the setup"
            else:
                text += " (as given)"
            out.append(text)
    out += ["", "layouts:"] + [f"  {lay.name}: {lay.note}" for lay in layouts]
    out += ["  with more data-parallel GPUs each step trains on more samples; the same global batch needs a "
            "smaller --grad-accum, which does not change a GPU's memory"]
    return "\n".join(out)


def _cmd_min_gpus(args, scenario, devices, layouts) -> int:
    limit = args.max_gpus or GPU_LIMIT
    with progress("searching GPU counts on each GPU profile", total=len(devices or GPU_PROFILES)) as bar:
        cards = min_gpus_per_card(scenario, devices, layouts, limit,
                                  progress=lambda i, n, name: bar.advance(0 if i == 0 else 1, f"searching on {name}"))
    fits_somewhere = any(c.n is not None for card in cards for c in card.counts)
    code = decide(args, 1 if args.check and not fits_somewhere else 0)
    if args.json:
        write_json({"scenario": scenario.name, "unit": "B", "max_gpus": limit,
                    "cards": [card.as_json() for card in cards], "assumed": assumed(scenario, devices=EACH_CARD)})
    else:
        print("\n".join([render_counts(scenario.name, cards, args.unit), "",
                         *assumed_lines(scenario, devices=EACH_CARD),
                         "  (at one GPU; each count changes the layout's knobs only)"]))
    return code


def register(sub) -> None:
    """Adds the `where` sub-command: the scenario on every GPU device profile."""
    w = sub.add_parser("where", help="on which GPUs the scenario fits, and the largest micro-batch on each")
    add_scenario_flags(w)
    add_host_flags(w)
    w.add_argument("--devices", metavar="NAME,NAME", help="GPU profiles to try (default: all): "
                                                          + ", ".join(GPU_PROFILES))
    w.add_argument("--no-max-batch", action="store_true",
                   help="skip the largest-micro-batch search (fit at the given micro-batch only)")
    w.add_argument("--min-gpus", action="store_true",
                   help="the fewest GPUs of each card that fit the scenario, per layout (FSDP2, ZeRO-3, TP), each "
                        "count simulated and the one below it")
    w.add_argument("--layouts", metavar="NAME,NAME", help="with --min-gpus: the layouts to search (default all): "
                   + ", ".join(lay.key for lay in LAYOUTS))
    w.add_argument("--max-gpus", type=int, metavar="N", help=f"with --min-gpus: search up to N GPUs (default "
                   f"{GPU_LIMIT})")
    w.add_argument("--check", action="store_true", help="exit 1 when the scenario fits on none of the profiles "
                   "(with --min-gpus: at no count searched)")
    w.add_argument("--json", action="store_true", help="print one JSON object (bytes)")
    w.set_defaults(func=cmd_where)
