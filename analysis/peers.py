"""Peers: what other people's formulas say for the same setup, next to what the simulation says.

Two kinds of peer figures:

- the ZeRO paper's model-state memory per device (Rajbhandari et al. 2020, section 5 and figure 1):
  with Psi parameters, N devices and K bytes of optimizer state per parameter (mixed-precision Adam:
  K = 12, fp32 master weights + exp_avg + exp_avg_sq), baseline (2 + 2 + K) Psi, optimizer-state
  sharding 2 Psi + 2 Psi + K Psi / N, adding gradients 2 Psi + (2 + K) Psi / N, adding parameters
  (2 + 2 + K) Psi / N;
- DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs` and
  `estimate_zero3_model_states_mem_needs`, no offload), called when deepspeed imports (`deepspeed_estimators`,
  its version printed), else their formulas as DeepSpeed 0.19.8's source writes them: ZeRO-2 GPU bytes
  2 Psi + int(18 Psi / N) (16-bit parameters, then 16-bit gradients 2 + fp32 gradients 4 + fp32 master 4 + Adam 8
  per parameter of the partition); ZeRO-3 4 x largest layer + int(18 Psi / N);
- `accelerate estimate-memory`'s "Training using Adam" at ZeRO-0 (it shards nothing), from accelerate's own
  functions where it imports, else accelerate 1.16.0's formula (analysis/peers_own.py `accelerate_estimate`).

Model states (parameters, gradients, fp32 masters, optimizer states) are the persistent rows; all the
formulas above leave out activations, temporaries, the batch, buffers, all-gather buffers and
reduce buckets, which is where a simulated peak is higher than any of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..simulator.events import Category, Event, EventLog, Pool
from ..simulator.timeline import timeline
from .units import Scale, format_bytes

MODEL_STATES = (Category.PARAMETER, Category.GRADIENT, Category.MASTER_PARAMETER, Category.OPTIMIZER_STATE)
DEEPSPEED_FORMULA_VERSION = "0.19.8"  # the DeepSpeed whose formulas deepspeed_zero2/3_estimate copy
ZERO2 = "estimate_zero2_model_states_mem_needs"
ZERO3 = "estimate_zero3_model_states_mem_needs"


def zero_paper_model_states(psi: int, world_size: int, stage: int, k: int = 12) -> float:
    """Bytes per device of the ZeRO paper's model-state formula (stage 0 = baseline data parallelism)."""
    n = world_size
    return {0: (2 + 2 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (2 + 2 + k) * psi / n}[stage]


def deepspeed_zero2_estimate(total_params: int, world_size: int) -> int:
    """DeepSpeed `estimate_zero2_model_states_mem_needs(..., cpu_offload=False)`: GPU bytes."""
    # deepspeed/runtime/zero/stage_1_and_2.py 0.19.8: gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
    return 2 * total_params + int(18 * total_params / world_size)


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, world_size: int) -> int:
    """DeepSpeed `estimate_zero3_model_states_mem_needs(..., cpu_offload=False)`: GPU bytes."""
    # deepspeed/runtime/zero/stage3.py 0.19.8: gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
    return 4 * largest_layer_params + int(18 * total_params / world_size)


@dataclass(frozen=True)
class DeepSpeedEstimators:
    """The DeepSpeed column's two functions and where they come from: `source` is printed with the table."""

    source: str
    version: str
    own: bool  # DeepSpeed's own functions (deepspeed imported), not peakledger's copies
    zero2: Callable[[int, int], int]  # (total_params, world_size) -> GPU bytes
    zero3: Callable[[int, int, int], int]  # (total_params, largest_layer_params, world_size) -> GPU bytes


def _formulas(why: str) -> DeepSpeedEstimators:
    return DeepSpeedEstimators(f"DeepSpeed {DEEPSPEED_FORMULA_VERSION}'s formulas ({why})", DEEPSPEED_FORMULA_VERSION,
                               False, deepspeed_zero2_estimate, deepspeed_zero3_estimate)


def deepspeed_estimators() -> DeepSpeedEstimators:
    """DeepSpeed's own estimators when deepspeed imports, else 0.19.8's formulas saying why (not installed, or the
    import's error: a broken install is a labelled column, not a failed command). Imported here, on demand:
    importing deepspeed takes a second or more and its accelerator probe logs a warning on stdout ("Setting
    accelerator to CPU", deepspeed/accelerator/real_accelerator.py 0.19.8), silenced for the import. All GPUs
    on one node: without offload, the GPU figure depends only on their product."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        import deepspeed  # first: a blocked or missing top package fails here, whatever submodules are cached
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2
        version = str(deepspeed.__version__)
    except Exception as e:  # noqa: BLE001 - any failure of a third party's import is a column from the formulas
        if isinstance(e, ImportError) and e.name == "deepspeed":
            return _formulas("deepspeed not installed")
        return _formulas(f"deepspeed did not import: {(str(e) or type(e).__name__).splitlines()[0]}")
    finally:
        logging.disable(previous)
    return DeepSpeedEstimators(
        f"DeepSpeed {version}, its own {ZERO2} and {ZERO3} (no offload)", version, True,
        lambda psi, n: zero2(psi, num_gpus_per_node=n, num_nodes=1, cpu_offload=False)[1],
        lambda psi, largest, n: zero3(psi, largest, num_gpus_per_node=n, num_nodes=1, cpu_offload=False,
                                      cpu_offload_params=False)[1])


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


def peak_moment(event: Event, rank: int) -> dict:
    return {"rank": rank, "step": event.step, "phase": event.phase.value, "op": event.op}


def peak_difference(higher: list[Event], lower: list[Event], names: int = 3) -> list[dict]:
    """What two peaks hold differently, from the allocation events of the blocks live at each (Timeline
    .live_allocs_at): per category whose bytes differ, the bytes at each peak and the blocks (by name, largest
    difference first, at most `names`, each with where it was allocated) on the side that holds more; the
    categories where `higher` holds the most more first."""
    def by_name(events: list[Event]) -> dict[str, tuple[Category, int, Event]]:
        out: dict[str, tuple[Category, int, Event]] = {}
        for e in events:
            _, n, first = out.get(e.block.name, (e.block.category, 0, e))
            out[e.block.name] = (e.block.category, n + e.block.nbytes, first)
        return out

    hi, lo = by_name(higher), by_name(lower)
    cats: dict[Category, list[int]] = {}
    for side, blocks in ((0, hi), (1, lo)):
        for cat, n, _ in blocks.values():
            cats.setdefault(cat, [0, 0])[side] += n
    rows = []
    for cat, (h, low) in cats.items():
        if h == low:
            continue
        more, less = (hi, lo) if h > low else (lo, hi)
        diffs = sorted(((n - less.get(name, (cat, 0))[1], name, e) for name, (c, n, e) in more.items()
                        if c is cat and n != less.get(name, (cat, 0))[1]), key=lambda t: (-abs(t[0]), t[1]))
        rows.append({"category": cat.value, "bytes": h, "other_bytes": low,
                     "blocks": [{"name": name, "bytes": d, "allocated": {"step": e.step, "phase": e.phase.value,
                                                                        "op": e.op}} for d, name, e in diffs[:names]],
                     "more_blocks": max(0, len(diffs) - names)})
    return sorted(rows, key=lambda r: (-(r["bytes"] - r["other_bytes"]), r["category"]))


__all__ = ["zero_paper_model_states", "deepspeed_zero2_estimate", "deepspeed_zero3_estimate", "model_state_peak",
           "largest_layer_params", "PeerRow", "MODEL_STATES", "DeepSpeedEstimators", "deepspeed_estimators",
           "DEEPSPEED_FORMULA_VERSION", "peak_difference", "peak_moment", "stage_difference_lines"]


PEER_NOTES = [
    "model states = parameters + gradients + fp32 masters + optimizer states, the most live at once (worst rank).",
    "the ZeRO paper's formula (K = 12) assumes mixed-precision Adam and counts exactly those; differences are "
    "padding, 4-byte step tensors, and a setup that is not bf16-mixed Adam.",
    f"DeepSpeed {DEEPSPEED_FORMULA_VERSION}'s ZeRO-2 estimate is 2P + 18P/N: 16-bit parameters, and per parameter of "
    "the partition 16-bit gradients 2 + fp32 gradients 4 + fp32 master 4 + Adam 8; the ZeRO paper has no fp32 "
    "gradients (2P + 14P/N), and peakledger holds that fp32 copy only in the optimizer step (a temporary) and the "
    "gradients' ipg reduce bucket in the backward (a bucket): neither is a model state.",
    "DeepSpeed's ZeRO-3 estimate adds 4 x the largest layer for the gathered parameters; peakledger counts the "
    "real all-gather buffers (with prefetch) and reduce buckets in the peak instead.",
    "accelerate estimate-memory's \"Training using Adam\" (accelerate 1.16.0 estimate_training_usage) is the largest "
    "of four terms of the model's fp32 size S (parameters and buffers), not their sum: 16-bit mixed precision model "
    "S, gradients 1.5 S, Adam 2 S, step 2 S (so 8 B per parameter); fp32 S, S, 2 S, 4 S (16 B); no sharding, so "
    "ZeRO-0 only. Its model is AutoModel of the config: the base model, without the LM head.",
    "no formula counts activations, temporaries, the batch or buffers: the simulated peak is above all of them.",
]


def _moment(m: dict) -> str:
    return f"rank {m['rank']}, step {m['step']} {m['phase']}, {m['op']}"


def stage_difference_lines(name: str, peak: int, other: str, other_peak: int, moment: dict, other_moment: dict,
                           rows: list[dict], f: Callable[[int], str]) -> list[str]:
    """One stage's peak above another's, said from the run: the two moments, then per category what it holds
    more (and less) there, naming the blocks and where each was allocated."""
    where = (f"both peak at {_moment(moment)}" if moment == other_moment
             else f"{name} peaks at {_moment(moment)}, {other} at {_moment(other_moment)}")
    lines = [f"{name} peaks above {other} ({f(peak)} vs {f(other_peak)}, +{f(peak - other_peak)}): {where}; "
             f"there {name} holds"]
    for r in rows:
        blocks = ", ".join(f"{b['name']} {f(abs(b['bytes']))} (allocated at step {b['allocated']['step']} "
                           f"{b['allocated']['phase']}, {b['allocated']['op']})" for b in r["blocks"])
        if r["more_blocks"]:
            blocks += f" and {r['more_blocks']} more"
        word = "more" if r["bytes"] > r["other_bytes"] else "less"
        lines.append(f"  {word} {r['category']}: {f(r['bytes'])} vs {f(r['other_bytes'])}: {blocks}")
    return lines + ["  and the same of every other category."]


def render_peers(name: str, rows: list[dict], unit: str | None) -> str:
    """`compare --peers` as text: per ZeRO stage, peakledger's model states and peak next to the formulas, where
    the DeepSpeed and accelerate columns come from (each peer's own function, or which version's formulas), and a
    stage peaking above the one before it explained from the run."""
    keys = ("model_states", "peak", "zero_paper", "deepspeed_estimate", "accelerate_estimate")
    g = Scale.of([r[k] for r in rows for k in keys if r.get(k) is not None], unit)  # one unit for the table
    f = lambda n: "-" if n is None else g.number(n)  # noqa: E731
    said_in = lambda n: format_bytes(n, g.unit)  # noqa: E731  (sizes in sentences carry their unit)
    lines = [f"{name}: {rows[0]['n_params']:,} parameters, {rows[0]['world_size']} ranks, DeepSpeed ZeRO stages "
             f"(bytes per rank; {g.unit})",
             f"{'stage':<8}{'peakledger states':>20}{'peakledger peak':>18}{'ZeRO paper':>14}{'DeepSpeed est.':>16}"
             f"{'accelerate':>14}"]
    for r in rows:
        lines.append(f"ZeRO-{r['stage']:<3}{f(r['model_states']):>20}{f(r['peak']):>18}{f(r['zero_paper']):>14}"
                     f"{f(r['deepspeed_estimate']):>16}{f(r.get('accelerate_estimate')):>14}")
    lines.append(f"DeepSpeed est.: {rows[0]['deepspeed_source']}")
    if rows[0].get("accelerate_source"):
        lines.append(f"accelerate: {rows[0]['accelerate_source']}")
    above = [(r, prev) for prev, r in zip(rows, rows[1:]) if r.get("above_previous")]
    if above:
        lines.append("why a stage peaks above the one before it (from the simulation's event log):")
        for r, prev in above:
            d = r["above_previous"]
            said = stage_difference_lines(f"ZeRO-{r['stage']}", r["peak"], f"ZeRO-{prev['stage']}", prev["peak"],
                                          d["moment"], d["other_moment"], d["categories"], said_in)
            lines += [f"  - {said[0]}"] + [f"  {line}" for line in said[1:]]
    lines.append("why they differ:")
    lines += [f"  - {note}" for note in PEER_NOTES]
    return "\n".join(lines)
