"""Compute planning before the model exists: the training FLOPs of N parameters on D tokens, the tokens a budget C
allows each N, the hours at a throughput, and a budget's (N, D) choices. Exact ints for FLOPs and tokens.

The rule: C = 6ND (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", arXiv:2001.08361, section 2.1:
a forward pass costs about 2N FLOPs per token and the backward twice that; N the non-embedding parameters, d_model
well above n_ctx / 12). `rule_terms` is that with N as given (a mixture of experts: the parameters one token runs
through). With the model known, `model_terms` adds what 6N leaves out, from the same paper's Table 1, each term
printed on its own, per training token (3 x the forward):
- the non-embedding parameters: 6 x N_non-embedding;
- attention over the context: 6 x n_layer x n_ctx x d_attn (Table 1, "Attention: Mask", 2 n_layer n_ctx d_attn per
  token forward). Hoffmann et al. 2022's appendix F (arXiv:2203.15556, Table A4) counts the logits and the weighted
  sum both, with no causal mask: 12 n_layer n_ctx d_attn, twice this;
- the vocabulary head: 6 x d_model x n_vocab (Table 1, "De-embed", 2 d_model n_vocab forward); the embedding
  lookups do no matmul (their 4 d_model per token is left out).

Time: wall-clock = D / (tokens per second, all GPUs), a throughput measured by the user; or the cost model's
(models/devices.py `sustained_flops`: a vendor peak x an assumed efficiency, labelled as such): C / (GPUs x FLOP/s).
GPU-hours = wall-clock x GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ..models.compute_shape import ModelShape
from .report import training_flops

KAPLAN = "Kaplan et al. 2020, arXiv:2001.08361"
CHINCHILLA_RATIO = 20  # tokens per parameter
CHINCHILLA = ("Hoffmann et al. 2022 (Chinchilla, 'Training Compute-Optimal Large Language Models', arXiv:2203.15556) "
              "found the lowest final training loss at a fixed compute budget with parameters and tokens grown about "
              "equally, about 20 tokens per parameter (Chinchilla: 70B parameters, 1.4T tokens). Its conditions: dense "
              "decoder-only transformers of 70M to 16B parameters (over 400 runs, then the 70B), under one epoch of "
              "MassiveText, a cosine schedule matched to each run's length; it weighs training compute only, not "
              "inference cost, downstream tasks, other data, mixtures of experts or repeated data. A reference, not a "
              "verdict on a plan: runs trained far past it on purpose (a smaller model, cheaper to serve) are common")
REPEATED = ("Muennighoff et al. 2023 ('Scaling Data-Constrained Language Models', arXiv:2305.16264) found up to about "
            "4 epochs of repeated data changed the loss negligibly against unique data at a fixed compute budget, and "
            "the value of more repetition decaying towards zero after (decoder-only models up to 9B parameters and "
            "900B tokens)")
CHOICE_RATIOS = (1, 10_000)  # the (N, D) table of a budget: N on the 1-2-5 grid with D / N in this range
CHOICE_STEPS = (1, 2, 5)


@dataclass(frozen=True)
class Term:
    """One part of the training FLOPs per token."""

    name: str
    per_token: int
    formula: str

    def as_json(self) -> dict:
        return {"name": self.name, "flops_per_token": self.per_token, "formula": self.formula}


def rule_terms(n_active: int) -> tuple[Term, ...]:
    """6N per token, N the parameters a token runs through (`training_flops` of one token)."""
    return (Term("6N", training_flops(n_active, 1), f"6 x N = 6 x {n_active:,}"),)


def model_terms(shape: ModelShape) -> tuple[Term, ...]:
    """Kaplan et al.'s Table 1 terms of `shape`, per training token (see the module docstring)."""
    L, T, A = shape.n_layer, shape.seq_len, shape.d_attn
    return (Term("non-embedding parameters", training_flops(shape.n_non_embedding, 1),
                 f"6 x N_non-embedding = 6 x {shape.n_non_embedding:,}"),
            Term("attention", 6 * L * T * A, f"6 x n_layer x n_ctx x d_attn = 6 x {L} x {T:,} x {A:,}"),
            Term("vocabulary head", 6 * shape.d_model * shape.vocab_size,
                 f"6 x d_model x n_vocab = 6 x {shape.d_model:,} x {shape.vocab_size:,}"))


@dataclass(frozen=True)
class Candidate:
    """One model size to plan: its parameters (all, and per token) and how its FLOPs per token are counted; a
    measured throughput for it, tokens per second over all its GPUs (None: none measured)."""

    label: str
    method: str  # "6N", or "Kaplan terms" with the model known
    n_params: int
    n_active: int
    terms: tuple[Term, ...]
    tokens_per_s: Fraction | None = None

    @property
    def flops_per_token(self) -> int:
        return sum(t.per_token for t in self.terms)


@dataclass(frozen=True)
class CostModel:
    """The cost model's rate (models/devices.py): `flops_per_s` per GPU, and the words that label it."""

    flops_per_s: float
    label: str


@dataclass(frozen=True)
class PlanRow:
    label: str
    method: str
    n_params: int
    n_active: int
    flops_per_token: int
    tokens: int  # D: tokens seen (given, or the budget's)
    compute: int  # flops_per_token x tokens
    unique_tokens: int | None = None
    seconds: float | None = None
    gpu_hours: float | None = None

    @property
    def tokens_per_param(self) -> float:
        """D / N, N the parameters a token runs through (the FLOP-counted ones)."""
        return self.tokens / self.n_active

    @property
    def epochs(self) -> float | None:
        return None if self.unique_tokens is None else self.tokens / self.unique_tokens

    def as_json(self) -> dict:
        return {"label": self.label, "method": self.method, "n_params": self.n_params, "n_active": self.n_active,
                "flops_per_token": self.flops_per_token, "tokens": self.tokens, "compute_flops": self.compute,
                "tokens_per_param": self.tokens_per_param,
                "tokens_per_total_param": self.tokens / self.n_params, "unique_tokens": self.unique_tokens,
                "epochs": self.epochs, "wall_clock_s": self.seconds,
                "wall_clock_h": None if self.seconds is None else self.seconds / 3600, "gpu_hours": self.gpu_hours}


def row(c: Candidate, tokens: int, unique_tokens: int | None, gpus: int, cost: CostModel | None) -> PlanRow:
    """The plan of `c` on `tokens`: its FLOPs, and its time from its measured throughput, else `cost`'s rate."""
    compute = c.flops_per_token * tokens
    seconds = None
    if c.tokens_per_s is not None:
        seconds = float(tokens / c.tokens_per_s)  # exact, rounded once
    elif cost is not None:
        seconds = compute / (gpus * cost.flops_per_s)
    return PlanRow(c.label, c.method, c.n_params, c.n_active, c.flops_per_token, tokens, compute, unique_tokens,
                   seconds, None if seconds is None else seconds * gpus / 3600)


def tokens_for(compute: int, flops_per_token: int) -> int:
    """The whole tokens `compute` FLOPs train at `flops_per_token`: floor(C / FLOPs per token)."""
    return compute // flops_per_token


def choices(compute: int, ratios: tuple[int, int] = CHOICE_RATIOS) -> list[int]:
    """The parameter counts N on the 1-2-5 grid (1, 2, 5 x 10^k) whose tokens per parameter under `compute` by 6ND,
    D / N = C / (6 N^2), lie within `ratios` (exact integer comparisons), smallest first."""
    lo, hi = ratios
    out = []
    for k in range(0, 40):
        for step in CHOICE_STEPS:
            n = step * 10**k
            if 6 * n * n * lo > compute:
                return out
            if 6 * n * n * hi >= compute:
                out.append(n)
    return out


def chinchilla_point(compute: int) -> tuple[int, int]:
    """(N, D) with D = 20 N and 6ND = C: N = sqrt(C / 120), rounded down to a whole parameter."""
    n = math.isqrt(compute // (6 * CHINCHILLA_RATIO))
    return n, CHINCHILLA_RATIO * n


@dataclass(frozen=True)
class Plan:
    """A compute plan: `question` "compute" (N and D given: C), "tokens" (C and N given: the D each N gets) or
    "choices" (C alone: a table of (N, D)); one row per candidate; the time source's label (None: no time asked);
    the model's shape and FLOPs terms when it is known; the references and assumptions printed with it."""

    question: str
    rows: tuple[PlanRow, ...]
    compute_budget: int | None
    gpus: int
    time_source: str | None
    model: ModelShape | None
    terms: tuple[Term, ...]
    references: tuple[str, ...]
    assumed: tuple[tuple[str, str], ...]

    def as_json(self) -> dict:
        m = self.model
        return {"question": self.question, "compute_budget_flops": self.compute_budget, "gpus": self.gpus,
                "time_source": self.time_source,
                "model": None if m is None else {
                    "name": m.name, "source": m.source, "n_params": m.n_params, "n_active": m.n_active,
                    "n_embedding": m.n_embedding, "n_non_embedding": m.n_non_embedding, "n_layer": m.n_layer,
                    "d_model": m.d_model, "d_attn": m.d_attn, "vocab_size": m.vocab_size, "seq_len": m.seq_len,
                    "experts": m.experts},
                "terms": [t.as_json() for t in self.terms], "rows": [r.as_json() for r in self.rows],
                "chinchilla_reference": None if self.compute_budget is None else dict(zip(
                    ("n_params", "tokens"), chinchilla_point(self.compute_budget))),
                "references": list(self.references), "assumed": dict(self.assumed)}


__all__ = ["Term", "Candidate", "CostModel", "PlanRow", "Plan", "rule_terms", "model_terms", "row", "tokens_for",
           "choices", "chinchilla_point", "CHINCHILLA", "REPEATED", "KAPLAN", "CHOICE_RATIOS", "CHINCHILLA_RATIO"]
