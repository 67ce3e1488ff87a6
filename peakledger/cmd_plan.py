"""`peakledger plan`: a training run's compute before the model exists (the logic: peakledger/plan.py and
analysis/compute_plan.py).

    peakledger plan --params 5e7 --tokens 2e8                       # C = 6ND = 6.00e16 FLOPs
    peakledger plan --compute 1e21 --params 125M,1B,7B --tokens-per-s-per-gpu 3000 --gpus 8
    peakledger plan --compute 6e16                                  # a table of (N, D) choices
    peakledger plan --preset gpt2 --tokens 2e10 --device H100-80GB --gpus 8   # + attention and head terms
"""

from __future__ import annotations

from .analysis.compute_plan import KAPLAN, Plan, chinchilla_point
from .analysis.units import fixed_significant, format_count, format_duration, format_sci
from .assumed import topic_lines
from .cli_common import table_lines, write_json
from .plan import COMPUTE_DTYPES, plan

QUESTIONS = {"compute": "the training FLOPs of each model size on the tokens given",
             "tokens": "the tokens a compute budget of {} FLOPs trains each model size on",
             "choices": "the (N, D) choices a compute budget of {} FLOPs allows, 6ND = C"}


def _model_lines(p: Plan) -> list[str]:
    m = p.model
    if m is None:
        return []
    active = f", {format_count(m.n_active)} active ({m.experts})" if m.experts else ""
    out = [f"{m.name}: {format_count(m.n_params)} parameters{active}, {format_count(m.n_non_embedding)} "
           f"{'active ' if m.experts else ''}non-embedding (embedding tables and an untied head: "
           f"{format_count(m.n_embedding)}), {m.n_layer} layers, "
           f"d_model {m.d_model:,}, d_attn {m.d_attn:,}, vocabulary {m.vocab_size:,}, n_ctx {m.seq_len:,}",
           f"training FLOPs per token ({KAPLAN}, Table 1: 3 x the forward):"]
    total = sum(t.per_token for t in p.terms)
    rows = [(t.name, t.formula, format_sci(t.per_token), f"{100 * t.per_token / total:.1f}%") for t in p.terms]
    rows.append(("total", "", format_sci(total), "100%"))
    out += ["  " + line for line in table_lines(("term", "formula", "FLOPs/token", "share"), rows)]
    rule = 6 * m.n_active
    pct = 100 * (total - rule) / rule
    out.append(f"  6N over the {format_count(m.n_active)} {'active ' if m.experts else ''}parameters gives "
               f"{format_sci(rule)}: the terms are {'+' if pct >= 0 else ''}{fixed_significant(pct, 2)}% on it")
    out.append("  Hoffmann et al. 2022's appendix F (arXiv:2203.15556) counts attention's two matmuls with no causal "
               "mask: 12 x n_layer x n_ctx x d_attn, twice the attention term")
    return out + [""]


def render(p: Plan) -> str:
    moe = any(r.n_active < r.n_params for r in p.rows)
    unique = any(r.unique_tokens is not None for r in p.rows)
    timed = p.time_source is not None
    budget = format_sci(p.compute_budget) if p.compute_budget is not None else ""
    out = [f"plan: {QUESTIONS[p.question].format(budget)}", ""]
    out += _model_lines(p)
    cols = ["N", *(["active N"] if moe else []), *(["method"] if p.model is not None else []), "FLOPs/token",
            "D tokens", *(["unique tokens", "epochs"] if unique else []),
            "tokens/active param" if moe else "tokens/param", "C FLOPs",
            *(["wall-clock", "GPU-hours"] if timed else [])]
    rows = []
    for r in p.rows:
        rows.append([format_count(r.n_params) if p.model is None else f"{p.model.name} {format_count(r.n_params)}",
                     *([format_count(r.n_active)] if moe else []), *([r.method] if p.model is not None else []),
                     format_sci(r.flops_per_token), format_count(r.tokens),
                     *([format_count(r.unique_tokens), fixed_significant(r.epochs)] if unique else []),
                     fixed_significant(r.tokens_per_param), format_sci(r.compute),
                     *([format_duration(r.seconds), fixed_significant(r.gpu_hours)] if timed else [])])
    out += table_lines(cols, rows)
    out.append("")
    if timed:
        out.append(f"time: {p.time_source}")
    if p.compute_budget is not None and p.question != "compute":
        out.append("D = floor(C / FLOPs per token); C FLOPs is what those D tokens take (at most "
                   f"{format_sci(p.compute_budget)})")
    out.append("reference, not a verdict: " + p.references[0])
    if p.compute_budget is not None:
        n, d = chinchilla_point(p.compute_budget)
        out.append(f"  at C = {format_sci(p.compute_budget)} (6ND), 20 tokens per parameter is N = {format_count(n)}, "
                   f"D = {format_count(d)}")
    out += [f"reference: {ref}" for ref in p.references[1:]]
    return "\n".join(out + ["", *topic_lines(dict(p.assumed))])


def cmd_plan(args) -> int:
    result = plan(args.params, active_params=args.active_params, tokens=args.tokens, compute=args.compute,
                  unique_tokens=args.unique_tokens, preset=args.preset, hf_config=args.hf_config, seq_len=args.seq_len,
                  tokens_per_s=args.tokens_per_s, tokens_per_s_per_gpu=args.tokens_per_s_per_gpu, gpus=args.gpus,
                  device=args.device, compute_dtype=args.compute_dtype)
    if args.json:
        write_json(result.as_json())
    else:
        print(render(result))
    return 0


def register(sub) -> None:
    """Adds the `plan` sub-command."""
    p = sub.add_parser("plan", help="a training budget before the model exists: C = 6ND, the tokens a compute budget "
                                    "allows each model size, hours at a measured throughput, (N, D) choices")
    p.add_argument("--params", action="append", metavar="N",
                   help="model sizes: 5e7, 1e9, 7B, 125M (K/M/B/T = 1e3..1e12); several comma-separated or repeated")
    p.add_argument("--active-params", action="append", metavar="N",
                   help="a mixture of experts: the parameters one token runs through, one per --params value")
    p.add_argument("--preset", metavar="NAME", help="a known model instead of --params (as every command takes it): "
                                                    "its own parameters, with the attention and vocabulary-head terms")
    p.add_argument("--hf-config", metavar="PATH", help="a transformers config.json (a causal LM) instead of --params")
    p.add_argument("--seq-len", metavar="T", help="with --preset / --hf-config: the context the attention term counts "
                                                  "(default: the model's default training sequence)")
    p.add_argument("--tokens", metavar="D", help="tokens trained on (2e8, 20B): the compute each size takes")
    p.add_argument("--compute", metavar="C", help="a budget in FLOPs (6e16, 1.2e20): the tokens it allows each size; "
                                                  "alone, a table of (N, D) choices")
    p.add_argument("--unique-tokens", metavar="U", help="the unique tokens of the data set: tokens seen / U = epochs")
    t = p.add_argument_group("time (one source)")
    t.add_argument("--tokens-per-s", action="append", metavar="R",
                   help="a measured throughput over all --gpus (one, or one per --params value)")
    t.add_argument("--tokens-per-s-per-gpu", action="append", metavar="R",
                   help="a measured throughput per GPU, times --gpus")
    t.add_argument("--device", help="no measurement: peakledger's cost model, the device's vendor peak x an assumed "
                                    "efficiency (models/devices.py), labelled as such")
    t.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, help="with --device: whose peak (default bf16)")
    t.add_argument("--gpus", metavar="G", help="GPUs the run uses (default 1): GPU-hours = wall-clock x G")
    p.add_argument("--json", action="store_true", help="print one JSON object (exact integer FLOPs and tokens)")
    p.set_defaults(func=cmd_plan, unit=None)
