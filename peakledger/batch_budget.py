"""`peakledger max-batch --fixed X --per-sample Y --budget Z`: the micro-batches the abstract memory model
M(B) = X + Y x B allows under Z, before any model exists.

    peakledger max-batch --fixed 100 --per-sample 30 --budget 200          # B in 1..3
    peakledger max-batch --fixed 30GiB --per-sample 1.5GiB --budget 80GiB --json

The search is `max-batch`'s own (analysis/maxbatch.py `max_fitting`, exponential then binary search over exact
ints), checked against the closed form floor((Z - X) / Y) on every answer. A B fits when M(B) <= Z: equality at
the limit fits. Values are exact Python ints at any size up to 2^256 (no overflow near 2^63 or anywhere), written
as whole numbers in any unit of your own (100, 9223372036854775807) or all as sizes (80GiB, 24G, 80GB, 512B: the
units of --budget everywhere); a mix of the two is refused, since 20 next to 80GiB could mean 20 bytes or 20 GiB.

Exit status: 0 with the answer, a feasible range or "no feasible micro-batch" alike (max-batch's contract);
with --check, 1 when no B fits. Bad input: 2, one line naming the flag.
"""

from __future__ import annotations

from .analysis.maxbatch import ABSTRACT_FLAGS, FORMS, BatchRange, solve
from .analysis.units import format_bytes
from .cli_common import decide, write_json
from .inputs import scenario_flags_given
from .models.config import ConfigError


def render(r: BatchRange, in_bytes: bool, unit: str | None) -> str:
    def f(n: int) -> str:
        return f"{n:,}" + (f" ({format_bytes(n, unit or 'auto')})" if in_bytes and n >= 1024 else "")

    what = "bytes" if in_bytes else "units of your own"
    out = [f"memory M(B) = fixed + per-sample x B = {f(r.fixed)} + {f(r.per_sample)} x B, budget {f(r.budget)} "
           f"({what}); a micro-batch B fits when M(B) <= budget, equality included"]
    b = r.max_batch
    if b >= 1:
        spare = r.budget - r.memory(b)
        out.append(f"feasible micro-batches: 1..{b:,}")
        out.append(f"  at B = {b:,}: M = {f(r.memory(b))}, " + (f"{f(spare)} spare" if spare else
                                                                  "exactly the budget (equality fits)"))
        out.append(f"  at B = {b + 1:,}: M = {f(r.memory(b + 1))}, over the budget by {f(r.memory(b + 1) - r.budget)}")
    elif b == 0:
        out.append(f"no feasible micro-batch: the fixed part fits ({f(r.fixed)}), but B = 1 needs {f(r.memory(1))}, "
                   f"over the budget by {f(r.memory(1) - r.budget)}")
    else:
        out.append(f"no feasible micro-batch: the fixed part alone ({f(r.fixed)}) is over the budget by "
                   f"{f(r.fixed - r.budget)}")
    out.append(f"search: max-batch's exponential then binary search (analysis/maxbatch.py max_fitting) over exact "
               f"ints, equal to the closed form floor((budget - fixed) / per-sample) = {r.closed_form:,}"
               + (" (below 0: -1, the fixed part alone over)" if r.closed_form < 0 else ""))
    return "\n".join(out)


def cmd_batch_budget(args) -> int:
    """max-batch with --fixed / --per-sample: no scenario, the abstract model only."""
    for name in ("fixed", "per_sample", "budget"):
        if getattr(args, name) is None:
            raise ConfigError(name, f"{ABSTRACT_FLAGS[name]} is missing: --fixed, --per-sample and --budget go "
                                    "together (the memory model M(B) = fixed + per-sample x B under the budget), "
                                    f"each {FORMS}")
    scenario = scenario_flags_given(args)
    if scenario:
        raise ConfigError("fixed", f"--fixed / --per-sample give the memory model themselves: drop {scenario[0]} "
                                   "(or drop them to search a real model's micro-batch)")
    result, in_bytes = solve(args.fixed, args.per_sample, args.budget)
    code = decide(args, 1 if args.check and not result.feasible else 0)
    if args.json:
        write_json({"model": "abstract: M(B) = fixed + per_sample x B", "values_in": "bytes" if in_bytes else
                    "units of your own", **result.as_json(),
                    "search": "analysis/maxbatch.py max_fitting, checked against the closed form"})
        return code
    print(render(result, in_bytes, args.unit))
    if args.check:
        print("fit check: FITS (B = 1 and up to the maximum)" if result.feasible else
              "fit check: DOES NOT FIT (not even B = 1)")
    return code


__all__ = ["render", "cmd_batch_budget"]
