"""`where` for an RL run (--rl grpo, models/rl.py) on one card: the largest rollout batch that fits, and, with a
colocated vLLM engine, the range of vllm_gpu_memory_utilization that fits.

- The rollout batch is the generation batch, micro_batch x grad_accum rows (TRL's steps_per_generation =
  gradient_accumulation_steps), num_generations completions per prompt, which TRL requires to divide it. The search
  is `max-batch`'s (analysis/maxbatch.py `max_fitting`, each probe re-simulated and judged by CardFit) over the
  micro-batches TRL accepts at this grad_accum: the multiples of num_generations / gcd(num_generations, grad_accum).
  With vLLM the engine's own bound is beside it: the sequences of seq_len tokens its KV pool holds at once at the
  given utilization (models/vllm_engine.py `max_rollout_batch`; more rows are generated in waves, not an OOM).
- The utilization range: the least is `min_utilization` (the pool holds one request of max_model_len); the largest
  is the smaller of `max_utilization` (vLLM starts beside the training process's own simulated holdings at the
  engine's start: its tensors then, read from the simulated run, + the CUDA context) and the largest whose
  re-simulated run fits the card (CardFit): both ends checked by simulation, between them a bisection on a 0.01 grid
  (a larger pool holds more: the device total does not fall as the utilization rises).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from . import api
from .analysis.maxbatch import max_fitting
from .analysis.units import format_bytes
from .models.config import ConfigError
from .models.devices import DeviceProfile
from .models.rl import engine_spec
from .models.vllm_engine import max_rollout_batch, max_utilization, min_utilization, size_engine
from .scenario import Scenario
from .simulator.events import Pool
from .simulator.timeline import timeline

REFUSED = "vllm_gpu_memory_utilization"  # the field of vLLM's refusal to start (models/rl.py)
ENGINE_START = "vllm.LLM"  # the engine's first op (models/rl.py GrpoRun.load)
GRID = 100  # utilizations between the ends are searched in hundredths


@dataclass(frozen=True)
class RlFit:
    """An RL run on one card of `budget` bytes."""

    budget: int
    micro_batch: int  # as given
    grad_accum: int
    num_generations: int
    seq_len: int
    step: int | None  # the micro-batches TRL accepts: multiples of this (None: not searched, --no-max-batch)
    max_micro_batch: int | None  # the largest accepted micro-batch that fits; 0: not even `step`
    # vLLM only (None without it)
    utilization: float | None = None  # as given
    in_use: int | None = None  # the training process's simulated device bytes at the engine's start (+ context)
    pool_blocks: int | None = None  # the KV pool at `utilization`
    pool_sequences: int | None = None  # sequences of seq_len the pool holds at once (no max_num_seqs cap)
    engine_bound: int | None = None  # max_rollout_batch: the same, capped at TRL's max_num_seqs (the rows)
    u_min: float | None = None  # min_utilization
    u_start: float | None = None  # max_utilization beside `in_use`
    u_fit: float | None = None  # the largest checked that starts and fits; None: none does
    u_min_fits: bool | None = None  # the run at u_min fits the card
    u_over: float | None = None  # the smallest checked above u_fit that does not fit (None: u_fit = u_start)

    @property
    def max_rows(self) -> int | None:
        return None if self.max_micro_batch is None else self.max_micro_batch * self.grad_accum

    def lines(self, device: str) -> list[str]:
        g, out = self.num_generations, []
        if self.max_micro_batch:
            out = [f"{device}: largest rollout batch that fits: {self.max_rows:,} rows (micro-batch "
                   f"{self.max_micro_batch:,} x grad_accum {self.grad_accum} = {self.max_rows // g:,} prompts x {g} "
                   f"generations; micro-batches searched in multiples of {self.step})"]
        elif self.max_micro_batch == 0:
            out = [f"{device}: no rollout batch fits (not micro-batch {self.step}, the least with {g} generations "
                   f"dividing micro-batch x grad_accum {self.grad_accum})"]
        if self.utilization is None:
            return out
        out.append(f"{device}: vLLM at utilization {self.utilization}: a KV pool of {self.pool_blocks:,} blocks holds "
                   f"{self.pool_sequences:,} sequences of {self.seq_len:,} tokens at once; max_rollout_batch "
                   f"{self.engine_bound:,} (TRL's max_num_seqs = {self.micro_batch * self.grad_accum:,} rows)")
        held = format_bytes(self.in_use, "GiB")
        if self.u_min > self.u_start:
            out.append(f"{device}: no vllm_gpu_memory_utilization fits: one {self.seq_len:,}-token request needs "
                       f"{self.u_min}, vLLM starts only up to {self.u_start} beside the training process's {held}")
        elif self.u_fit is None:
            out.append(f"{device}: no vllm_gpu_memory_utilization fits: at {self.u_min} (the least whose pool holds "
                       f"one {self.seq_len:,}-token request) the run is already over the card")
        else:
            top = (f"{self.u_fit} (vLLM starts up to {self.u_start} beside the training process's {held}"
                   + (f"; the run fits the card up to {self.u_fit}, not at {self.u_over})" if self.u_over is not None
                      else ", and the run fits there)"))
            out.append(f"{device}: vllm_gpu_memory_utilization that fits: {self.u_min} (the least whose pool holds "
                       f"one {self.seq_len:,}-token request) to {top}")
        return out

    def as_json(self) -> dict:
        return {"rollout_micro_batch_step": self.step, "max_rollout_micro_batch": self.max_micro_batch,
                "max_rollout_batch": self.max_rows, "grad_accum": self.grad_accum,
                "num_generations": self.num_generations,
                **({} if self.utilization is None else {
                    "vllm_gpu_memory_utilization": self.utilization, "engine_start_in_use": self.in_use,
                    "kv_pool_blocks": self.pool_blocks, "kv_pool_sequences": self.pool_sequences,
                    "max_rollout_batch_engine": self.engine_bound, "min_utilization": self.u_min,
                    "max_utilization_starts": self.u_start, "max_utilization_fits": self.u_fit,
                    "min_utilization_fits": self.u_min_fits, "utilization_over": self.u_over})}


def engine_start_holdings(report, rank: int = 0) -> int | None:
    """The device bytes `rank`'s tensors hold just before the engine's start in the simulated run (None: no engine)."""
    live = 0
    for e in timeline(report.log, rank, Pool.DEVICE).events:
        if e.op == ENGINE_START:
            return live
        live += e.delta
    return None


def _verdict(scenario: Scenario, budget: int, **changes) -> bool:
    """The scenario with `changes` re-simulated and judged on the card; False where vLLM refuses to start."""
    try:
        report = api.run(dataclasses.replace(scenario, setup=scenario.setup.replace(**changes)))
    except ConfigError as e:
        if e.field == REFUSED:
            return False
        raise
    return api.card_fit(report, budget).fits


def rollout_search(scenario: Scenario, budget: int) -> tuple[int, int]:
    """(step, the largest micro-batch, a multiple of step, whose run fits `budget`; 0 when `step` does not)."""
    s = scenario.setup
    g, ga = s.rl.num_generations, s.batch.grad_accum
    step = g // math.gcd(g, ga)
    cache: dict[int, bool] = {}

    def need(k: int) -> int:  # k + 1 multiples of step: 0 when it fits, 1 when not (a budget of 0)
        if k not in cache:
            cache[k] = _verdict(scenario, budget, micro_batch=(k + 1) * step)
        return 0 if cache[k] else 1

    found = max_fitting(need, 0, api.MAX_BATCH_LIMIT // step - 1)
    return step, (found + 1) * step


def utilization_range(scenario: Scenario, budget: int, in_use: int) -> dict:
    """min_utilization, max_utilization beside `in_use`, and the largest utilization between them whose run fits."""
    spec = engine_spec(scenario.model, scenario.setup)
    low, start = min_utilization(spec, budget), max_utilization(budget, in_use)
    out = {"u_min": low, "u_start": start}
    if low > start:
        return out
    fits = lambda u: _verdict(scenario, budget, vllm_gpu_memory_utilization=u)  # noqa: E731
    out["u_min_fits"] = fits(low)
    if not out["u_min_fits"]:
        return out
    if fits(start):
        return {**out, "u_fit": start}
    grid = [k / GRID for k in range(math.floor(low * GRID) + 1, math.ceil(start * GRID)) if low < k / GRID < start]
    points = [low, *grid, start]
    lo, hi = 0, len(points) - 1  # points[lo] fits, points[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(points[mid]) else (lo, mid)
    return {**out, "u_fit": points[lo], "u_over": points[hi]}


def rl_fit(scenario: Scenario, report, profile: DeviceProfile, search: bool = True) -> RlFit:
    """`scenario` (an RL run, already on `profile`; `report` its simulated run) on the card."""
    s, budget = scenario.setup, profile.memory_bytes
    step, best = rollout_search(scenario, budget) if search else (None, None)
    fit = RlFit(budget, s.batch.micro_batch, s.batch.grad_accum, s.rl.num_generations, s.batch.seq_len, step, best)
    held = engine_start_holdings(report, report.peaks.rank)
    if s.rl.vllm != "colocate" or held is None:
        return fit
    in_use = held + profile.context_bytes
    spec = engine_spec(scenario.model, s)
    sizing = size_engine(spec, budget, in_use)
    return dataclasses.replace(
        fit, utilization=s.rl.vllm_gpu_memory_utilization, in_use=in_use, pool_blocks=sizing.num_blocks,
        pool_sequences=max_rollout_batch(dataclasses.replace(spec, max_num_seqs=max(1, sizing.num_blocks)), sizing,
                                         s.batch.seq_len),
        engine_bound=max_rollout_batch(spec, sizing, s.batch.seq_len),
        **utilization_range(scenario, budget, in_use))


__all__ = ["RlFit", "rl_fit", "rollout_search", "utilization_range", "engine_start_holdings"]
