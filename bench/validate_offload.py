"""Optimizer-state offload vs the simulator: real CPU runs of the reference offload
(`traces.reference.StateOffload`, what prime-rl's CPUOffloadOptimizer and Megatron's chunked offload do)
against the simulation of the same scenario, and the first-step transient on GPU profiles.

    python bench/validate_offload.py

Each config runs 3 real training steps under the exact allocation tracker, once with the offload and once
without. The tracker counts the offload's host buffers as host memory (Pool.HOST), as the simulator does,
so "device" is what a GPU would hold. Checked per config: every optimizer and zero_grad phase peak and the
host peak exact; the load / forward / backward phases off by exactly what the same run is off without the
offload (it does not touch them); and whether the first step is above the steady state, measured and
predicted. Writes the "Optimizer-state offload" section of bench/VALIDATION.md (the rest is kept).
"""

from __future__ import annotations

import itertools
import platform
import sys
import time

from sections import replace_section  # bench/sections.py, beside this script

from peakledger import build_scenario
from peakledger.api import run
from peakledger.validation import validate, validate_ranks

SECTION = "## Optimizer-state offload"
BASE = dict(micro_batch=2, seq_len=32, steps=3)


def base_for(preset: str) -> dict:
    """BASE for a preset: an MLP has no sequence, so no seq_len."""
    return {k: v for k, v in BASE.items() if k != "seq_len" or preset != "tiny-mlp"}


def chunking(mode: str, chunk: int, prefetch: int | None = None) -> dict:
    """The chunk knobs, given only where they apply (optimizer_offload chunked)."""
    if mode != "chunked":
        return {}
    return {"offload_chunk_params": chunk, **({} if prefetch is None else {"offload_prefetch": prefetch})}
MODELS = {"tiny": 30_000, "tiny-llama": 30_000, "tiny-mlp": 150_000}  # preset -> chunk (parameter elements)
OPTIMIZERS = [("adamw", "foreach"), ("adamw", "for-loop"), ("amsgrad", "fused"), ("sgd-momentum", "foreach")]
PRECISIONS = {"tiny": ["fp32", "bf16-autocast", "bf16"], "tiny-llama": ["fp32", "bf16"], "tiny-mlp": ["fp32", "bf16"]}
MODES = [("states", "whole", 0), ("chunked", "whole", 0), ("chunked", "whole", 1), ("chunked", "chunked", 1)]
OFFLOAD_FIELDS = ("optimizer_offload", "offload_chunk_params", "offload_prefetch", "offload_first_step")
RANK_CASES = [("tiny-mlp", "fsdp2"), ("tiny", "fsdp2"), ("tiny-llama", "fsdp2"), ("tiny-mlp", "ddp"), ("tiny", "ddp")]
GPU_CASES = [  # (label, model, training): simulated only
    ("llama-3-8b, pure bf16, 1 x H100-80GB, seq 8192, full ckpt", "llama-3-8b",
     dict(precision="bf16", seq_len=8192, micro_batch=1, checkpointing="full")),
    ("llama-3-8b, bf16-mixed, FSDP2 x 8, seq 8192, full ckpt", "llama-3-8b",
     dict(precision="bf16-mixed", seq_len=8192, micro_batch=1, checkpointing="full", dp_engine="fsdp2", world_size=8)),
]


def phase(v, label: str) -> int:
    return next(p.measured for p in v.phases if p.label == label)


def forward_backward_peak(v) -> int:
    return max(p.measured for p in v.phases if p.label.startswith(("forward", "backward")))


def pair(p) -> str:
    return f"{p.measured:,} / {p.predicted:,}"


def exact(v, prefixes) -> bool:
    """Every phase named by `prefixes` has the same peak on both sides."""
    return all(g == 0 for g in gaps(v, prefixes).values())


def host_exact(v) -> bool:
    return v.host is not None and v.host.measured == v.host.predicted


def gaps(v, prefixes) -> dict[str, int]:
    return {p.label: p.predicted - p.measured for p in v.phases if p.label.startswith(prefixes)}


def run_case(preset: str, optimizer: str, impl: str, precision: str, mode: str, first: str, prefetch: int,
             plain: dict) -> dict:
    training = dict(base_for(preset), optimizer=optimizer, optimizer_impl=impl, precision=precision,
                    optimizer_offload=mode, offload_first_step=first, **chunking(mode, MODELS[preset], prefetch))
    v, _, _ = validate(build_scenario({"preset": preset}, training, {"device": "cpu"}))
    label = f"{preset}, {optimizer} {impl}, {precision}, " + (
        "states" if mode == "states" else f"chunked ({MODELS[preset]:,}), prefetch {prefetch}, first {first}")
    return {"label": label, "v": v, "plain": plain["v"],
            "optimizer_exact": exact(v, ("optimizer", "zero_grad")),
            "host_exact": host_exact(v),
            "other_same": gaps(v, ("load", "forward", "backward")) == gaps(plain["v"], ("load", "forward", "backward"))}


def plain_run(preset: str, optimizer: str, impl: str, precision: str) -> dict:
    training = dict(base_for(preset), optimizer=optimizer, optimizer_impl=impl, precision=precision)
    v, _, _ = validate(build_scenario({"preset": preset}, training, {"device": "cpu"}))
    return {"label": f"{preset}, {optimizer} {impl}, {precision}", "v": v}


def rank_runs() -> list[dict]:
    """2 real ranks per case on torch's fake process group (traces/reference/build.py StateOffload around the
    engine's optimizer: FSDP2's DTensor states, DDP's whole ones), chunked, first step whole."""
    out = []
    for preset, engine in RANK_CASES:
        training = dict(base_for(preset), precision="fp32", world_size=2, dp_engine=engine,
                        optimizer_offload="chunked", **chunking("chunked", MODELS[preset] // 2))
        results, _ = validate_ranks(build_scenario({"preset": preset}, training, {"device": "cpu"}), backend="fake")
        for rank, (v, _log) in enumerate(results):
            out.append({"label": f"{preset}, {engine} x 2, rank {rank}", "v": v,
                        "optimizer_exact": exact(v, ("optimizer",)), "host_exact": host_exact(v)})
    return out


def rank_table(rows: list[dict]) -> list[str]:
    lines = ["| rank | device first step, measured / predicted B | device steady, measured / predicted B | "
             "host peak, measured / predicted B | optimizer phases |", "|---|---:|---:|---:|---|"]
    for r in rows:
        v = r["v"]
        lines.append(f"| {r['label']} | {pair(v.first_step)} | "
                     f"{pair(v.steady)} | {pair(v.host)} | "
                     f"{'exact' if r['optimizer_exact'] else 'DIFFER'} |")
    return lines


def cpu_table(results: list[dict]) -> list[str]:
    lines = ["| config | device first step, measured / predicted B | device steady, measured / predicted B | "
             "first > steady | host peak, measured / predicted B | optimizer phases | load/fwd/bwd gaps as without "
             "| overall error |", "|---|---:|---:|---|---:|---|---|---:|"]
    for r in results:
        v = r["v"]
        above = v.first_step.measured > v.steady.measured
        agree = above == (v.first_step.predicted > v.steady.predicted)
        lines.append(f"| {r['label']} | {pair(v.first_step)} | "
                     f"{pair(v.steady)} | {'yes' if above else 'no'}"
                     f"{'' if agree else ' (sim DISAGREES)'} | {pair(v.host)} | "
                     f"{'exact' if r['optimizer_exact'] else 'DIFFER'} | {'yes' if r['other_same'] else 'NO'} | "
                     f"{v.overall.error:+.3%} |")
    return lines


def plain_table(plains: list[dict]) -> list[str]:
    lines = ["| config (no offload) | first step, measured / predicted B | steady, measured / predicted B | "
             "steady >= first |", "|---|---:|---:|---|"]
    for p in plains:
        v = p["v"]
        lines.append(f"| {p['label']} | {pair(v.first_step)} | "
                     f"{pair(v.steady)} | "
                     f"{'yes' if v.steady.measured >= v.first_step.measured else 'NO'} |")
    return lines


def gpu_table() -> list[str]:
    lines = ["| scenario (simulated) | offload | first-step peak | steady peak | host peak | step time |",
             "|---|---|---:|---:|---:|---:|"]
    for label, model, training in GPU_CASES:
        for mode, first in (("none", "whole"), ("states", "whole"), ("chunked", "whole"), ("chunked", "chunked")):
            report = run(build_scenario({"preset": model}, dict(training, optimizer_offload=mode,
                                                                offload_first_step=first)))
            pk, gib = report.peaks, 2**30
            name = mode if mode != "chunked" else f"chunked, first step {first}"
            lines.append(f"| {label} | {name} | {pk.first_step.bytes / gib:.2f} GiB | {pk.steady.bytes / gib:.2f} GiB "
                         f"| {report.host.overall.bytes / gib if report.host else 0:.2f} GiB | "
                         f"{report.time_per_step_s:.2f} s |")
    return lines


def render(results: list[dict], plains: list[dict], ranks: list[dict], seconds: float) -> str:
    n = len(results)
    optimizer_exact = sum(r["optimizer_exact"] for r in results)
    host_exact = sum(r["host_exact"] for r in results)
    other_same = sum(r["other_same"] for r in results)
    above = [r for r in results if r["v"].first_step.measured > r["v"].steady.measured]
    agree = sum((r["v"].first_step.measured > r["v"].steady.measured) ==
                (r["v"].first_step.predicted > r["v"].steady.predicted) for r in results)
    whole_chunked = [r for r in results if "first whole" in r["label"]]
    others = [r for r in whole_chunked if r not in above]
    outside = [r for r in above if r not in whole_chunked]
    as_high = sum(phase(r["v"], "optimizer step 2") >= phase(r["v"], "optimizer step 1") for r in others)
    backward_higher = sum(phase(r["v"], "optimizer step 2") < phase(r["v"], "optimizer step 1")
                          <= forward_backward_peak(r["v"]) for r in others)
    steady_first = sum(p["v"].steady.measured >= p["v"].first_step.measured for p in plains)
    within = sum(abs(r["v"].overall.error) <= 0.01 for r in results)
    return "\n".join([
        SECTION, "",
        "The reference offload (`traces.reference.StateOffload` around torch.optim; `--optimizer-offload`) run for "
        f"real on the CPU, 3 steps, micro-batch 2, seq 32, exact allocation tracker; {n} offload configs, "
        f"{len(plains)} runs of the same configs without it, and 2-rank runs, {seconds:.1f} s on {platform.machine()}. "
        "Host buffers "
        "are host memory on both sides; \"device\" is everything else, what a GPU would hold. Regenerate with "
        "`python bench/validate_offload.py`.", "",
        f"**Summary: optimizer and zero_grad phase peaks exact in {optimizer_exact}/{n}; host peak exact in "
        f"{host_exact}/{n}; load/forward/backward phases off by exactly what the run without the offload is off in "
        f"{other_same}/{n}; first step above the steady state measured in {len(above)}/{n} (the simulation says "
        f"the same in {agree}/{n}): {len(above) - len(outside)} of the {len(whole_chunked)} chunked offloads whose "
        f"first step is one whole step(), and {len(outside)} other configs" + (
            f" (in the other {len(others)} of those, the steady optimizer step is as high as the first in {as_high}, "
            f"its window of chunks holding as much as the whole step; a forward/backward peak is higher in "
            f"{backward_higher})" if others else "") +
        f"; overall device peak within 1% in {within}/{n}. Without the offload the steady peak is at or above the "
        f"first-step peak in {steady_first}/{len(plains)} measured "
        "runs.**", "",
        "Why the first step: torch creates optimizer states lazily, inside the first `step()`, beside each "
        "parameter (on its device). An offload wrapper that runs that first step as one whole `step()` has "
        "every state and every foreach temporary on the device at once before it can move any to the host; "
        "from step 2 the states live in host buffers and only a chunk (plus `offload_prefetch` ahead) is on "
        "the device at a time. Without an offload the lazily created states stay for every later step, so the "
        "first step is never above the steady state: an OOM \"at the first optimizer step\" there is the first "
        "moment the full state exists, and would recur. `offload_first_step = \"chunked\"` creates and offloads "
        "the states chunk by chunk (Megatron-LM PR 6544), which removes the transient.", "",
        *cpu_table(results), "",
        "Without the offload, the same runs (the baseline of the column \"gaps as without\"):", "",
        *plain_table(plains), "",
        f"Data-parallel ranks: the offload around FSDP2's DTensor states (prime-rl's setting) and DDP's, 2 real "
        f"ranks each on torch's fake process group, chunked, first step whole, 3 steps. Optimizer phases exact on "
        f"{sum(r['optimizer_exact'] for r in ranks)}/{len(ranks)} ranks, host peak exact on "
        f"{sum(r['host_exact'] for r in ranks)}/{len(ranks)}; first step above the "
        f"steady state predicted on {sum(r['v'].first_step.predicted > r['v'].steady.predicted for r in ranks)}/"
        f"{len(ranks)} and measured on {sum(r['v'].first_step.measured > r['v'].steady.measured for r in ranks)}/"
        f"{len(ranks)}. The offload acts in the optimizer phases; a gap elsewhere is the training steps' own (see "
        "the data-parallel section: since every FSDP2 collective waits for the process group to release its "
        "tensors, no all-gather output is freed late).", "",
        *rank_table(ranks), "",
        "What it means on a GPU (simulated; H100-80GB profile, AdamW foreach, chunks of 100,000,000 parameters, "
        "prefetch 1; step time from the cost model, host link 50 GB/s assumed, device-to-host copies blocking):", "",
        *gpu_table(), "",
        "- Device peaks a few bytes apart (a backward phase's 4- or 8-byte scalars) differ exactly as the same run "
        "without the offload does (column \"gaps as without\"); the offload's own lifetimes (device copies, host "
        "buffers, per-chunk temporaries, the first step's lazily created states) are exact.",
        "- Not run for real here: a GPU (pinned buffers, copies on streams: the simulation's timing is the cost "
        "model's), the offload around ZeroRedundancyOptimizer's local optimizer (simulated; `validate --world-size` "
        "refuses it), "
        "prime-rl's `prepare_checkpoint_save`, which copies every state back to the device for a save (a save "
        "here reads the host buffers, as Megatron PR 6544 does).", ""])


def main() -> int:
    t0 = time.perf_counter()
    results, plains = [], []
    for preset, (optimizer, impl) in itertools.product(MODELS, OPTIMIZERS):
        for precision in PRECISIONS[preset]:
            plain = plain_run(preset, optimizer, impl, precision)
            plains.append(plain)
            for mode, first, prefetch in MODES:
                r = run_case(preset, optimizer, impl, precision, mode, first, prefetch, plain)
                results.append(r)
                v = r["v"]
                print(f"{v.first_step.measured:>11,} {v.steady.measured:>11,}  optimizer "
                      f"{'exact' if r['optimizer_exact'] else 'DIFF '}  host {'exact' if r['host_exact'] else 'DIFF '}"
                      f"  {r['label']}", flush=True)
    ranks = rank_runs()
    section = render(results, plains, ranks, time.perf_counter() - t0)
    replace_section(SECTION, section)
    print(section.splitlines()[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
