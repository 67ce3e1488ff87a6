"""Expert parallelism on real runs (gloo, 127.0.0.1) vs the simulator, per rank.

HF Mixtral (transformers' MixtralForCausalLM, random weights) with its experts placed on `ep` CPU processes and the
tokens moved by all-to-all as torchtitan's `ExpertParallel` moves them (traces/expert_run.py), every rank measured
with the project's tracker, and simulated (models/parallel/expert.py) on the "cpu" profile with the routing the run
recorded (`moe_routing="counts:FILE"`). Routing "measured" is the randomly initialised routers' own; "worst" zeroes
the routers, so ties in top-k send every token of every rank to the same k experts, all on one or two ranks.
Prints the "Expert parallelism (real CPU runs)" section of bench/VALIDATION.md; `--write` swaps it into the file.
bench/validate_parallel.py runs it too, after its own section.

    python bench/validate_expert.py [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

from sections import replace_section  # bench/sections.py, beside this script

from peakledger.analysis.validate import compare_logs, static_rows
from peakledger.models.config import TrainingSetup, TransformerConfig
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.traces.expert_run import measure_expert_parallel

SECTION = "## Expert parallelism (real CPU runs)"
MIXTRAL_4 = TransformerConfig(name="tiny-mixtral-4e", architecture="llama", implementation="hf", n_layer=2, d_model=64,
                              n_head=4, n_kv_head=2, d_ff=96, vocab_size=256, max_seq_len=64, num_local_experts=4,
                              num_experts_per_tok=2)
MIXTRAL_8 = dataclasses.replace(MIXTRAL_4, name="tiny-mixtral-8e", num_local_experts=8, n_layer=3)
CASES = [  # (model, ep, dp = world_size, precision, routing)
    (MIXTRAL_4, 2, 2, "fp32", "measured"), (MIXTRAL_4, 2, 2, "fp32", "worst"), (MIXTRAL_4, 2, 2, "bf16", "measured"),
    (MIXTRAL_4, 4, 4, "fp32", "measured"), (MIXTRAL_8, 4, 4, "bf16", "measured"), (MIXTRAL_8, 4, 4, "fp32", "worst"),
    (MIXTRAL_4, 2, 4, "fp32", "measured"),
]


def compare_case(cfg: TransformerConfig, ep: int, dp: int, precision: str, routing: str, tmp: str) -> dict:
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision=precision, optimizer="adamw", steps=2, world_size=dp,
                          ep=ep, dp_engine="ddp")
    t0 = time.perf_counter()
    measured, counts = measure_expert_parallel(cfg, setup, routing=routing)
    seconds = time.perf_counter() - t0
    path = os.path.join(tmp, f"{cfg.name}-{ep}-{dp}-{precision}-{routing}.json")
    with open(path, "w") as f:
        json.dump(counts, f)
    routed = setup.replace(moe_routing=f"counts:{path}")
    graph = describe(cfg, routed, "cpu", ranks=list(range(dp)), all_steps=True)
    simulated = simulate(graph)
    received = graph.metadata.expert_parallel["received_rows"]
    rows = []
    for rank, log in enumerate(measured):
        v = compare_logs(log, simulated, rank=rank)
        phase = {p.label: p for p in v.phases}
        rows.append({"rank": rank, "measured": v.overall.measured, "predicted": v.overall.predicted,
                     "error": v.overall.error, "forward": phase["forward step 1"], "backward": phase["backward step 1"],
                     "static": static_rows(log, rank) == static_rows(simulated, rank),
                     "received": received[str(rank % ep)]})
    return {"rows": rows, "seconds": seconds, "sent": graph.metadata.expert_parallel["sent_rows"]}


def expert_section() -> str:
    """The section: every case run for real and simulated."""
    lines = [SECTION, "",
             "Regenerate with `python bench/validate_expert.py --write` "
             "(or bench/validate_parallel.py, which writes it after "
             "its own section; real runs, gloo on 127.0.0.1, torch 2.13, "
             "transformers 5.25; AdamW foreach, micro-batch 2, seq 32, 2 steps, world_size = dp, DDP for the "
             "dense parameters with the experts ignored; with dp > ep the ranks holding the same experts average "
             "their gradients in place before the step). Every rank trains on the same micro-batch with lr 0, so "
             "every rank routes like the one counts table the run records, which the simulation reads. Rows: the "
             "(token, expert) rows a rank receives per MoE layer (it sends micro-batch x seq x top-k = 128). "
             "Static rows: parameter + gradient + optimizer-state bytes when step 1's optimizer phase ends.", "",
             "| model | ep x dp | precision | routing | rank | rows received per layer | measured peak B | predicted "
             "peak B | error | forward peak measured / predicted B | backward peak measured / predicted B | "
             "static rows "
             "exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    worst, all_static, runs, spread = 0.0, True, 0.0, []
    with tempfile.TemporaryDirectory(prefix="peakledger-ep-bench-") as tmp:
        for cfg, ep, dp, precision, routing in CASES:
            case = compare_case(cfg, ep, dp, precision, routing, tmp)
            runs += case["seconds"]
            for r in case["rows"]:
                worst, all_static = max(worst, abs(r["error"])), all_static and r["static"]
                lines.append(f"| {cfg.name} | {ep} x {dp} | {precision} | {routing} | {r['rank']} | "
                             f"{', '.join(map(str, r['received']))} | {r['measured']:,} | {r['predicted']:,} | "
                             f"{r['error']:+.4%} | {r['forward'].measured:,} / {r['forward'].predicted:,} | "
                             f"{r['backward'].measured:,} / {r['backward'].predicted:,} | "
                             f"{'yes' if r['static'] else 'NO'} |")
            m = [r["measured"] for r in case["rows"]]
            p = [r["predicted"] for r in case["rows"]]
            spread.append((cfg.name, f"{ep} x {dp}", precision, routing, max(m) - min(m), max(p) - min(p)))
    lines += ["", "Busiest rank - least busy rank peak (what the routing puts apart):", "",
              "| model | ep x dp | precision | routing | measured B | predicted B |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {ep} | {pr} | {ro} | {a:,} | {b:,} |" for n, ep, pr, ro, a, b in spread]
    lines += ["", f"Worst per-rank peak error {worst:.4%} (target 1%); static rows exact on "
              f"{'every' if all_static else 'NOT every'} rank; the real runs took {runs:.0f} s. The bytes apart are "
              "DDP's: an 8-byte tensor of its construction freed later than modelled, and its initial broadcast's "
              "coalesced copy in the load phase.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="swap the section into bench/VALIDATION.md")
    args = parser.parse_args()
    section = expert_section()
    if args.write:
        replace_section(SECTION, section)
    sys.stdout.write(section)


if __name__ == "__main__":
    main()
