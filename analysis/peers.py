"""Peers: what other people's formulas say for the same setup, next to what the simulation says.

Two kinds of peer figures:

- the ZeRO paper's model-state memory per device (Rajbhandari et al. 2020, section 5 and figure 1):
  with Psi parameters, N devices and K bytes of optimizer state per parameter (mixed-precision Adam:
  K = 12, fp32 master weights + exp_avg + exp_avg_sq), baseline (2 + 2 + K) Psi, optimizer-state
  sharding 2 Psi + 2 Psi + K Psi / N, adding gradients 2 Psi + (2 + K) Psi / N, adding parameters
  (2 + 2 + K) Psi / N;
- DeepSpeed's own estimators, as its source computes them (`estimate_zero2_model_states_mem_needs`
  and `estimate_zero3_model_states_mem_needs`, no offload): ZeRO-2 GPU bytes 4 Psi + int(16 Psi / N)
  (2 Psi fp16 parameters + 2 Psi fp16 gradients, + fp32 master, fp32 gradients and two Adam states
  of the partition); ZeRO-3 4 x largest layer + int(18 Psi / N).

Model states (parameters, gradients, fp32 masters, optimizer states) are the persistent rows; all the
formulas above leave out activations, temporaries, the batch, buffers, all-gather buffers and
reduce buckets, which is where a simulated peak is higher than any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..simulator.events import Category, EventLog, Pool
from ..simulator.timeline import timeline
from .units import Scale

MODEL_STATES = (Category.PARAMETER, Category.GRADIENT, Category.MASTER_PARAMETER, Category.OPTIMIZER_STATE)


def zero_paper_model_states(psi: int, world_size: int, stage: int, k: int = 12) -> float:
    """Bytes per device of the ZeRO paper's model-state formula (stage 0 = baseline data parallelism)."""
    n = world_size
    return {0: (2 + 2 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (2 + 2 + k) * psi / n}[stage]


def deepspeed_zero2_estimate(total_params: int, world_size: int) -> int:
    """DeepSpeed `estimate_zero2_model_states_mem_needs(..., cpu_offload=False)`: GPU bytes."""
    return 4 * total_params + int(16 * total_params / world_size)


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, world_size: int) -> int:
    """DeepSpeed `estimate_zero3_model_states_mem_needs(..., cpu_offload=False)`: GPU bytes."""
    return 4 * largest_layer_params + int(18 * total_params / world_size)


def model_state_peak(log: EventLog, rank: int = 0, pool: Pool = Pool.DEVICE) -> int:
    """The most bytes of model states (parameters, gradients, masters, optimizer states) live at once."""
    running = best = 0
    for e in timeline(log, rank, pool).events:
        if e.block.category in MODEL_STATES:
            running += e.delta
            best = max(best, running)
    return best


@dataclass(frozen=True)
class PeerRow:
    source: str
    model_states: int | None  # bytes per rank, None when the peer does not say
    peak: int | None
    note: str


def largest_layer_params(param_shapes: dict[str, tuple[int, ...]]) -> int:
    """DeepSpeed's `largest_layer_params`: the most parameters any one module holds directly."""
    per_module: dict[str, int] = {}
    for name, shape in param_shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        module = name.rpartition(".")[0]
        per_module[module] = per_module.get(module, 0) + numel
    return max(per_module.values(), default=0)


__all__ = ["zero_paper_model_states", "deepspeed_zero2_estimate", "deepspeed_zero3_estimate", "model_state_peak",
           "largest_layer_params", "PeerRow", "MODEL_STATES"]


PEER_NOTES = [
    "model states = parameters + gradients + fp32 masters + optimizer states, the most live at once (worst rank).",
    "the ZeRO paper's formula (K = 12) assumes mixed-precision Adam and counts exactly those; differences are "
    "padding, 4-byte step tensors, and a setup that is not bf16-mixed Adam.",
    "DeepSpeed's ZeRO-2 estimate counts full fp16 gradients (4P) and an fp32 gradient partition (16P/N); its "
    "stage 2 keeps only the gradient partition plus the ipg bucket (a reduce bucket, not a model state).",
    "DeepSpeed's ZeRO-3 estimate adds 4 x the largest layer for the gathered parameters; peakledger counts the "
    "real all-gather buffers (with prefetch) and reduce buckets in the peak instead.",
    "no formula counts activations, temporaries, the batch or buffers: the simulated peak is above all of them.",
]


def render_peers(name: str, rows: list[dict], unit: str | None) -> str:
    """`compare --peers` as text: per ZeRO stage, peakledger's model states and peak next to the formulas."""
    keys = ("model_states", "peak", "zero_paper", "deepspeed_estimate")
    g = Scale.of([r[k] for r in rows for k in keys], unit)  # one unit for the table
    f = lambda n: "-" if n is None else g.number(n)  # noqa: E731
    lines = [f"{name}: {rows[0]['n_params']:,} parameters, {rows[0]['world_size']} ranks, DeepSpeed ZeRO stages "
             f"(bytes per rank; {g.unit})",
             f"{'stage':<8}{'peakledger states':>20}{'peakledger peak':>18}{'ZeRO paper':>14}{'DeepSpeed est.':>16}"]
    for r in rows:
        lines.append(f"ZeRO-{r['stage']:<3}{f(r['model_states']):>20}{f(r['peak']):>18}{f(r['zero_paper']):>14}"
                     f"{f(r['deepspeed_estimate']):>16}")
    lines.append("why they differ:")
    lines += [f"  - {note}" for note in PEER_NOTES]
    return "\n".join(lines)
