"""`peakledger plan` and `pl.plan`: a training run's compute before it exists (analysis/compute_plan.py holds the
arithmetic; this module reads and checks the inputs and assembles the plan).

Three questions, by what is given:
- N and D (`--params` or a model, and `--tokens`): the training FLOPs C of each N;
- C and N (`--compute`, and `--params` or a model): the tokens D the budget trains each N on;
- C alone: a table of (N, D) choices, N on the 1-2-5 grid with 1 to 10,000 tokens per parameter.
Optional: `--active-params` (a mixture of experts given by counts), `--unique-tokens` (repeated data: epochs),
time from a measured throughput (`--tokens-per-s` over all GPUs, or `--tokens-per-s-per-gpu` x `--gpus`) or from the
cost model (`--device`, labelled as such).

Counts are exact: '5e7', '1e9', '7B', '2.5e9', 50000000 (K, M, B, T = 1e3 .. 1e12; deadline.py `parse_amount`); a
float from Python is read as its shortest decimal (repr: 5e7 is 50,000,000, 1.2e20 is 1.2 x 10^20 exactly). Every
refusal is a ConfigError naming the flag and the allowed forms.
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

from .analysis.compute_plan import (
    CHINCHILLA,
    CHOICE_RATIOS,
    REPEATED,
    Candidate,
    CostModel,
    Plan,
    choices,
    model_terms,
    row,
    rule_terms,
    tokens_for,
)
from .analysis.units import format_count
from .deadline import COUNT_FORMS, parse_amount
from .models.compute_shape import ModelShape, model_shape
from .models.config import ConfigError
from .models.devices import device_profile
from .models.families import family_of
from .scenario import build_scenario

MAX_COMPUTE = 10**30  # FLOPs: far past any training run (the largest are near 1e26)
MAX_COUNT = 10**21  # parameters, tokens
MAX_RATE = 10**15  # tokens per second
MAX_GPUS = 10**7
MAX_SEQ = 10**9
RATE_FORMS = "a number > 0 of tokens per second: 3500, 3.5e3, 3.5k, 1.2M"
COMPUTE_DTYPES = ("bf16", "fp16", "tf32", "fp32")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _items(value, field: str) -> list:
    """A flag's values: one value, a comma-separated string, or a list of either (None: none)."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in values:
        out += [p for p in v.split(",")] if isinstance(v, str) else [v]
    if not out or any(isinstance(v, str) and not v.strip() for v in out):
        raise ConfigError(field, f"{_flag(field)} has an empty value in {value!r}; allowed: {COUNT_FORMS}, several "
                                 "comma-separated")
    return out


def _exact(value, field: str, limit: int, whole: bool = True, forms: str = COUNT_FORMS) -> Fraction:
    if isinstance(value, float):  # a Python float: the decimal it prints as (5e7 -> '50000000.0')
        value = repr(value)
    return parse_amount(value, field, limit=limit, whole=whole, forms=forms)


def _counts(value, field: str, limit: int = MAX_COUNT) -> list[int]:
    return [int(_exact(v, field, limit)) for v in _items(value, field)]


def _one(value, field: str, limit: int = MAX_COUNT) -> int | None:
    values = _counts(value, field, limit)
    if len(values) > 1:
        raise ConfigError(field, f"{_flag(field)} takes one value, got {len(values)}: {value!r}")
    return values[0] if values else None


def _model(preset: str | None, hf_config: str | None, seq_len: int | None) -> ModelShape:
    table = {"preset": preset} if preset is not None else {"hf_config": hf_config}
    scenario = build_scenario(table, {"seq_len": seq_len} if seq_len is not None else {}, {})
    family_of(scenario.model).check(scenario.model, scenario.setup)  # (the family's own: seq_len within its positions)
    return model_shape(scenario.model, scenario.setup.batch.seq_len)


def _candidates(params: list[int], active: list[int], shape: ModelShape | None) -> list[Candidate]:
    if shape is not None:
        which = "active" if shape.experts else "all"
        return [Candidate(shape.name, f"6N, N = {which} parameters", shape.n_params, shape.n_active,
                          rule_terms(shape.n_active)),
                Candidate(shape.name, "Kaplan terms", shape.n_params, shape.n_active, model_terms(shape))]
    if active and len(active) != len(params):
        raise ConfigError("active_params", f"--active-params gives {len(active)} values for {len(params)} --params: "
                                           "one per --params value, in the same order")
    out = []
    for i, n in enumerate(params):
        a = active[i] if active else n
        if a > n:
            raise ConfigError("active_params", f"--active-params {a:,} is more than its --params {n:,}: the "
                                               "parameters one token runs through are part of all of them")
        out.append(Candidate(format_count(n), "6N" + (", N = active parameters" if a < n else ""), n, a,
                             rule_terms(a)))
    return out


def _time(candidates: list[Candidate], tokens_per_s, tokens_per_s_per_gpu, gpus: int | None, device: str | None,
          compute_dtype: str | None) -> tuple[list[Candidate], CostModel | None, str | None, int]:
    """The candidates with their measured throughput (tokens per second over all GPUs), the cost model, the time
    source's label and the GPU count."""
    given = [f for f, v in (("tokens_per_s", tokens_per_s), ("tokens_per_s_per_gpu", tokens_per_s_per_gpu),
                            ("device", device)) if v is not None]
    if len(given) > 1:
        raise ConfigError(given[1], f"give one source of time, not {' and '.join(map(_flag, given))}: a measured "
                                    "throughput (--tokens-per-s or --tokens-per-s-per-gpu) or the cost model "
                                    "(--device)")
    if compute_dtype is not None and device is None:
        raise ConfigError("compute_dtype", "--compute-dtype picks the cost model's peak: it goes with --device")
    if not given:
        if gpus is not None:
            raise ConfigError("gpus", "--gpus prices a throughput: give --tokens-per-s, --tokens-per-s-per-gpu or "
                                      "--device with it")
        return candidates, None, None, 1
    n_gpus = 1 if gpus is None else gpus
    gpu_words = f"{n_gpus:,} GPU{'s' if n_gpus > 1 else ''}" + (" (--gpus, default 1)" if gpus is None else "")
    if device is not None:
        profile = device_profile(device)
        dtype = compute_dtype or "bf16"
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError("compute_dtype", f"unknown value {dtype!r}; allowed: {', '.join(COMPUTE_DTYPES)}")
        peak = profile.peak_dtype(dtype)
        rate = profile.sustained_flops(dtype)
        label = (f"peakledger's cost model (models/devices.py), not a measurement: {profile.name} vendor peak "
                 f"{profile.flops[peak] / 1e12:g} TFLOP/s {peak}" + (f" (no {dtype} path: {peak}'s)" if peak != dtype
                                                                     else "")
                 + f" x {profile.flops_efficiency:.0%} efficiency assumed = {rate / 1e12:g} TFLOP/s per GPU, "
                 f"{gpu_words}")
        return candidates, CostModel(rate, label), label, n_gpus
    field = given[0]
    rates = [_exact(v, field, MAX_RATE, whole=False, forms=RATE_FORMS) for v in _items(
        tokens_per_s if field == "tokens_per_s" else tokens_per_s_per_gpu, field)]
    if len(rates) not in (1, len(candidates)) or (len(rates) > 1 and len({c.label for c in candidates}) == 1):
        raise ConfigError(field, f"{_flag(field)} gives {len(rates)} throughputs for {len(candidates)} model sizes: "
                                 "give one (the same for every size) or one per --params value, in its order")
    per_gpu = field == "tokens_per_s_per_gpu"
    per = n_gpus if per_gpu else 1
    totals = [r * per for r in rates] * (len(candidates) if len(rates) == 1 else 1)
    shown = ", ".join(f"{float(r):,.6g}" for r in rates)
    label = (f"measured throughput {shown} tokens/s " + ("per GPU x " if per_gpu else "over ") + gpu_words
             + (" (the same for every size)" if len(rates) == 1 and len(candidates) > 1 else ""))
    return [Candidate(c.label, c.method, c.n_params, c.n_active, c.terms, t) for c, t in zip(candidates, totals)], \
        None, label, n_gpus


def plan(params=None, *, active_params=None, tokens=None, compute=None, unique_tokens=None, preset: str | None = None,
         hf_config: str | None = None, seq_len=None, tokens_per_s=None, tokens_per_s_per_gpu=None, gpus=None,
         device: str | None = None, compute_dtype: str | None = None) -> Plan:
    """The compute plan (see the module docstring); every value is checked as the CLI's flag of the same name."""
    n_params = _counts(params, "params")
    active = _counts(active_params, "active_params")
    d = _one(tokens, "tokens")
    c = _one(compute, "compute", MAX_COMPUTE)
    unique = _one(unique_tokens, "unique_tokens")
    n_gpus = _one(gpus, "gpus", MAX_GPUS)
    seq = _one(seq_len, "seq_len", MAX_SEQ)
    if preset is not None and hf_config is not None:
        raise ConfigError("preset", "give one model: --preset or --hf-config, not both")
    known = preset is not None or hf_config is not None
    if known and n_params:
        raise ConfigError("params", f"--params and {'--preset' if preset is not None else '--hf-config'} both give N: "
                                    "the model's own parameters are counted; drop one")
    if active and not n_params:
        raise ConfigError("active_params", "--active-params goes with --params (a model given by --preset or "
                                           "--hf-config counts its own active parameters)")
    if seq is not None and not known:
        raise ConfigError("seq_len", "--seq-len sets the context of a known model's attention term: it goes with "
                                     "--preset or --hf-config")
    if d is not None and c is not None:
        raise ConfigError("tokens", "give --tokens D (the compute N and D take) or --compute C (the tokens C allows), "
                                    "not both")
    if d is None and c is None:
        raise ConfigError("compute", "give --compute C (FLOPs, e.g. 6e16: the tokens it allows each size, or a table "
                                     "of sizes) or --tokens D (e.g. 2e8, with --params: the compute it takes)")
    if d is not None and not (n_params or known):
        raise ConfigError("params", "--tokens needs a model size: --params N (e.g. 5e7, 1B; several comma-separated) "
                                    "or --preset / --hf-config")
    shape = _model(preset, hf_config, seq) if known else None
    question = "compute" if d is not None else "tokens" if (n_params or known) else "choices"
    if question == "choices":
        n_params = choices(c)
        if not n_params:
            raise ConfigError("compute", f"--compute {c:,} FLOPs gives no size on the 1-2-5 grid with "
                                         f"{CHOICE_RATIOS[0]} to {CHOICE_RATIOS[1]:,} tokens per parameter; give "
                                         "--params to plan a size of your own")
    candidates = _candidates(n_params, active, shape)
    candidates, cost, source, n_gpus = _time(candidates, tokens_per_s, tokens_per_s_per_gpu, n_gpus, device,
                                             compute_dtype)
    rows = tuple(row(k, d if d is not None else tokens_for(c, k.flops_per_token), unique, n_gpus, cost)
                 for k in candidates)
    return Plan(question, rows, c, n_gpus, source, shape, model_terms(shape) if shape is not None else (),
                (CHINCHILLA,) + ((REPEATED,) if unique is not None else ()), _assumed(shape, source, unique, rows))


def _assumed(shape: ModelShape | None, source: str | None, unique: int | None,
             rows: Iterable) -> tuple[tuple[str, str], ...]:
    out = [("flops", "3 x the forward per training token (the backward twice the forward): no activation "
                     "recomputation (full checkpointing adds about a forward: 8N, not 6N), no optimizer step, no "
                     "padding; D counts every token trained on")]
    if any(r.n_active < r.n_params for r in rows):
        out.append(("experts", "a mixture of experts: N in 6N is the parameters one token runs through (the active "
                               "ones); all of them are in memory"))
    if shape is not None:
        out.append(("model", f"{shape.name}: {shape.source}; attention counted at n_ctx {shape.seq_len:,} (the "
                             "training sequence, --seq-len), every layer over the whole context (no sliding window, "
                             "no causal-mask saving)"))
    if source is not None:
        out.append(("time", f"{source}; every GPU busy the whole run (no evaluation, checkpoint saves, restarts or "
                            "queueing); GPU-hours = wall-clock x GPUs"))
    if unique is not None:
        out.append(("data", f"{unique:,} unique tokens (--unique-tokens); tokens seen = D; epochs = D / unique"))
    return tuple(out)


__all__ = ["plan", "MAX_COMPUTE", "MAX_COUNT", "MAX_RATE", "RATE_FORMS", "COMPUTE_DTYPES"]
