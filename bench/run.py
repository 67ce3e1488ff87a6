"""Benchmarks: simulation speed (one llama-3-70b step) and a max-batch search. Writes bench/RESULTS.md.

    python bench/run.py

Targets (from the foundation issue): one 70B step simulated in under 1 s; a max-batch search in
under 5 s. Times are wall-clock on whatever machine runs this; the machine is printed with them.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import replace

from sections import replace_sections  # bench/sections.py, beside this script

from peakledger import build_scenario, max_micro_batch
from peakledger.analysis.checkpointing import optimal_checkpointing, policy_table, render_optimal, render_table
from peakledger.analysis.report import summarize
from peakledger.analysis.units import format_bytes, parse_bytes
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.sweep import run_sweep

# the 1000-point sweep (also timed per engine by bench/sweep_engines.py)
SWEEP_GRID = {"micro_batch": list(range(1, 11)), "seq_len": [128, 256, 512, 768, 1024], "zero_stage": [0, 1, 2, 3],
              "precision": ["fp32", "bf16-mixed", "bf16-autocast", "bf16", "fp16-mixed"]}
SWEEP_BASE = ({"preset": "gpt2"}, {"steps": 1, "world_size": 8})


def best_of(n, fn):
    times, result = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> None:
    lines = ["# peakledger benchmarks", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
             "Best of 3 runs, wall-clock. Regenerate with `python bench/run.py` "
             "(its sections; other scripts' stay).", ""]
    lines += ["## One training step of llama-3-70b (bf16-mixed AdamW, micro-batch 1, seq 4096, 1 rank)", "",
              "| stage | seconds | ops | events | events/s |", "|---|---|---|---|---|"]
    s70 = build_scenario({"preset": "llama-3-70b"}, {"micro_batch": 1, "seq_len": 4096, "steps": 1})
    t_desc, graph = best_of(3, lambda: describe(s70.model, s70.setup, s70.device))
    t_sim, log = best_of(3, lambda: simulate(graph))
    n = len(log.events)
    lines.append(f"| describe (op graph) | {t_desc:.3f} | {len(graph):,} | | |")
    lines.append(f"| simulate (SimPy) | {t_sim:.3f} | {len(graph):,} | {n:,} | {n / t_sim:,.0f} |")
    total = t_desc + t_sim
    lines.append(f"| total | {total:.3f} | | | {n / total:,.0f} |")
    lines += ["", f"Target: under 1 s. {'Met' if total < 1 else 'NOT met'} ({total:.3f} s).", ""]
    lines += ["## One step of llama-3-70b (80 layers) on 64 data-parallel ranks", "",
              "Ranks with identical layouts are simulated once (`rank_classes`); the time includes finding them.", "",
              "| engine | seconds | ranks simulated | events | per-rank peak | target |", "|---|---|---|---|---|---|"]
    for label, changes in [("DeepSpeed ZeRO-3", dict(zero_stage=3)), ("FSDP2", dict(dp_engine="fsdp2"))]:
        sc = replace(s70, setup=s70.setup.replace(world_size=64, **changes))

        def one_step():
            g = describe(sc.model, sc.setup, sc.device)
            return g, simulate(g)
        t, (g, log) = best_of(3, one_step)
        peak = summarize(log).peaks.overall.bytes
        lines.append(f"| {label} | {t:.3f} | {len(g.metadata.rank_classes)} of 64 | {len(log.events):,} | "
                     f"{format_bytes(peak)} | {'met' if t < 1 else 'NOT met'} (< 1 s) |")
    lines.append("")
    lines += ["## Max micro-batch search (2 steps each probe, exact bisection)", "",
              "| scenario | budget | answer | seconds | target |", "|---|---|---|---|---|"]
    for preset, seq, budget in [("gpt2", 1024, "80GiB"), ("llama-3-8b", 8192, "80GiB"), ("llama-3-70b", 4096, "80GiB")]:
        sc = build_scenario({"preset": preset}, {"seq_len": seq, "micro_batch": 1},
                            {"device": "H100-80GB"})
        if preset == "llama-3-70b":
            sc = replace(sc, setup=sc.setup.replace(world_size=64, zero_stage=3))
        t, best = best_of(1, lambda: max_micro_batch(sc, parse_bytes(budget)))
        lines.append(f"| {preset} seq {seq}{' ZeRO-3 x64' if preset == 'llama-3-70b' else ''} | {budget} | {best} | "
                     f"{t:.2f} | {'met' if t < 5 else 'NOT met'} (< 5 s) |")
    lines.append("")
    budget80 = parse_bytes("80GiB")
    ck = build_scenario({"preset": "llama-3-8b"}, {"seq_len": 8192, "micro_batch": 2, "world_size": 8, "zero_stage": 3})
    t_table, rows = best_of(1, lambda: policy_table(ck))
    t_opt, best = best_of(1, lambda: optimal_checkpointing(ck, budget80))
    lines += ["## Activation checkpointing: llama-3-8b, seq 8192, micro-batch 2, ZeRO-3 x 8, budget 80 GiB", "",
              f"`peakledger checkpointing --preset llama-3-8b --seq-len 8192 --micro-batch 2 --world-size 8 "
              f"--zero-stage 3 --budget 80GiB` (table {t_table:.1f} s, search {t_opt:.1f} s):", "", "```",
              render_table(rows), "", render_optimal(best), "```", ""]
    s70_ck = build_scenario({"preset": "llama-3-70b"}, {"seq_len": 4096, "micro_batch": 1, "steps": 1,
                                                        "world_size": 64, "zero_stage": 3})
    none_peak = optimal_checkpointing(s70_ck, 1 << 60).peak
    all_peak = optimal_checkpointing(s70_ck, 1).peak
    budget70 = (none_peak + all_peak) // 2
    t_70, best70 = best_of(3, lambda: optimal_checkpointing(s70_ck, budget70))
    lines += ["## Least-recompute checkpointing search on 80 layers (llama-3-70b, seq 4096, ZeRO-3 x 64)", "",
              f"Budget {format_bytes(budget70)}, halfway between the peak with no layer checkpointed "
              f"({format_bytes(none_peak)}) and with all ({format_bytes(all_peak)}): {len(best70.layers)} of 80 layers "
              f"checkpointed, {'fits' if best70.fits else 'does NOT fit'} after verification; {t_70:.2f} s: "
              f"{'met' if t_70 < 5 else 'NOT met'} (target < 5 s).", ""]
    lines += ["## A 1000-point sweep (gpt2, 1 step, 8 ranks, every core)", "",
              "micro_batch 1-10 x seq_len 128-1024 (5) x ZeRO stage 0-3 x precision (5), `peakledger sweep` "
              "machinery (peakledger/sweep.py), results in grid order.", ""]
    base = build_scenario(*SWEEP_BASE)
    t, result = best_of(1, lambda: run_sweep(base, SWEEP_GRID, progress=False))
    lines += [f"{len(result)} points in {t:.1f} s on {os.cpu_count()} cores: "
              f"{'met' if t < 60 else 'NOT met'} (target < 60 s).", ""]
    text = "\n".join(lines) + "\n"
    replace_sections(text, os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))  # others' kept
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
