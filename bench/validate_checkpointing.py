"""Activation checkpointing policies: real CPU training runs vs the simulator, and the layer search.

    python bench/validate_checkpointing.py            # every config (70 real runs, under a minute)
    python bench/validate_checkpointing.py --quick    # every third config

The reference GPT (nanoGPT, preset "tiny": 2 layers, d_model 64; and the same with 4 layers) and the
small Llama (preset "tiny-llama", fp32 only: its autocast tape has known gaps of its own, listed under
the table) run 2 AdamW steps (micro-batch 4, seq 64) under every policy of `TrainingSetup.checkpointing`
(models/tape.py), on the CPU under the exact allocation tracker, against the simulation of the same
scenario (`peakledger.validation.validate`). Then, simulated only: the policy table of GPT-2 small on an
H100-80GB (`analysis.checkpointing.policy_table`), and `optimal_checkpointing` on llama-3-70b (its
timing, and a brute force over every subset of a 4-layer model's layers).

Writes the "## Activation checkpointing policies" section of bench/VALIDATION.md (the rest is kept).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import platform
import sys
import time

from sections import replace_section  # bench/sections.py, beside this script

from peakledger import build_scenario
from peakledger.analysis.checkpointing import (
    DEFAULT_POLICIES,
    layer_costs,
    optimal_checkpointing,
    policy_table,
    render_table,
)
from peakledger.validation import validate

SECTION = "## Activation checkpointing policies"
TRAINING = dict(micro_batch=4, seq_len=64, steps=2, optimizer="adamw")
POLICIES = DEFAULT_POLICIES  # none, full, every-k (k = 2), selective, sqrt, op-policy, offload


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    n_layer: int
    precision: str
    attention: str
    policy: str

    @property
    def label(self) -> str:
        return f"{self.preset} {self.n_layer}L, {self.precision}, {self.attention}, {self.policy}"

    def scenario(self):
        return build_scenario({"preset": self.preset, "n_layer": self.n_layer, "attention": self.attention},
                              {**TRAINING, "precision": self.precision, "checkpointing": self.policy},
                              name=self.label)


def all_cases() -> list[Case]:
    gpt = [Case("tiny", n, p, a, c) for n, p, a, c in itertools.product(
        [2, 4], ["fp32", "bf16-autocast"], ["eager", "sdpa"], POLICIES)]
    llama = [Case("tiny-llama", 2, "fp32", a, c) for a, c in itertools.product(["eager", "sdpa"], POLICIES)]
    return gpt + llama


def run_case(case: Case) -> dict:
    t0 = time.perf_counter()
    v, measured, simulated = validate(case.scenario())
    phases = [p for p in v.phases if p.label.startswith(("forward", "backward"))]
    worst = max(phases, key=lambda p: abs(p.error))
    top = v.unexplained[0] if v.unexplained else None
    return {"case": case, "measured": v.overall.measured, "predicted": v.overall.predicted, "error": v.overall.error,
            "worst_phase": worst, "unexplained": f"{top[0]}: {top[1].name} ({top[1].nbytes:,} B)" if top else "-",
            "seconds": time.perf_counter() - t0}


def validation_table(results: list[dict]) -> list[str]:
    lines = ["| config | measured peak B | predicted peak B | error | worst fwd/bwd phase | largest unexplained "
             "tensor |", "|---|---:|---:|---:|---|---|"]
    for r in results:
        w = r["worst_phase"]
        lines.append(f"| {r['case'].label} | {r['measured']:,} | {r['predicted']:,} | {r['error']:+.3%} | "
                     f"{w.label} {w.error:+.3%} | {r['unexplained']} |")
    return lines


def per_policy(results: list[dict]) -> list[str]:
    lines = ["| policy | configs | within 1% | worst error | worst fwd/bwd phase error |", "|---|---:|---:|---:|---:|"]
    for policy in POLICIES:
        rs = [r for r in results if r["case"].policy == policy]
        if not rs:
            continue
        worst = max(rs, key=lambda r: abs(r["error"]))
        phase = max((r["worst_phase"] for r in rs), key=lambda p: abs(p.error))
        lines.append(f"| {policy} | {len(rs)} | {sum(abs(r['error']) <= 0.01 for r in rs)} | {worst['error']:+.3%} | "
                     f"{phase.error:+.3%} |")
    return lines


def search_checks() -> tuple[list[str], dict]:
    """optimal_checkpointing: timing on llama-3-70b, and a brute force over a 4-layer model's subsets."""
    lines = ["| scenario | budget | layers checkpointed | verified peak | model's peak | recompute of fwd+bwd | "
             "simulations | seconds |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    timings = []
    for label, model, training in [
            ("llama-3-70b, B=4 T=8192, bf16-mixed, 1 device", {"preset": "llama-3-70b"},
             {"micro_batch": 4, "seq_len": 8192}),
            ("llama-3-70b, B=1 T=8192, ZeRO-3 x 64", {"preset": "llama-3-70b"},
             {"micro_batch": 1, "seq_len": 8192, "world_size": 64, "zero_stage": 3})]:
        scenario = build_scenario(model, training)
        costs, plain, full = layer_costs(scenario)
        for frac in (0.25, 0.75):
            budget = full.capacity_needed + int(frac * (plain.capacity_needed - full.capacity_needed))
            t0 = time.perf_counter()
            r = optimal_checkpointing(scenario, budget)
            seconds = time.perf_counter() - t0  # timed here: the search result holds no wall-clock field
            timings.append(seconds)
            share = r.recompute_flops / r.model_flops if r.model_flops else 0.0
            lines.append(f"| {label} | {budget / 2**30:.2f} GiB | {len(r.layers)} of {r.n_layers} | "
                         f"{r.peak / 2**30:.3f} GiB | {r.predicted_peak / 2**30:.3f} GiB | {share:.1%} | "
                         f"{r.simulations} | {seconds:.2f} |")
    brute = brute_force()
    return lines, {"timings": timings, **brute}


def brute_force() -> dict:
    """Every subset of a 4-layer tiny GPT's layers simulated; for budgets between the all-checkpointed and
    the plain peak, the search's answer must fit and no subset may fit at a lower recompute."""
    from peakledger.analysis.checkpointing import simulate_run, step_flops, with_checkpointed_layers

    scenario = build_scenario({"preset": "tiny", "n_layer": 4}, {**TRAINING, "precision": "bf16-autocast"},
                              {"device": "cpu"})
    subsets = [s for k in range(5) for s in itertools.combinations(range(4), k)]
    runs = {s: simulate_run(with_checkpointed_layers(scenario, s)) for s in subsets}
    cost = {s: step_flops(r.graph, r.rank, scenario.setup.batch.steps)[1] for s, r in runs.items()}
    budgets = sorted({r.capacity_needed for r in runs.values()})
    agree = 0
    for budget in budgets:
        r = optimal_checkpointing(scenario, budget)
        best = min(cost[s] for s, run in runs.items() if run.capacity_needed <= budget)
        agree += r.fits and runs[r.layers].capacity_needed <= budget and cost[r.layers] == best
    return {"budgets": len(budgets), "agree": agree, "subsets": len(subsets)}


def render(results: list[dict], n_all: int, seconds: float, table: str, search: list[str], checks: dict) -> str:
    within = sum(abs(r["error"]) <= 0.01 for r in results)
    worst = max(results, key=lambda r: abs(r["error"]))
    phases = sum(abs(r["worst_phase"].error) <= 0.01 for r in results)
    return "\n".join([
        SECTION, "",
        "Policies of `TrainingSetup.checkpointing` (models/tape.py): none; full (every layer one "
        "`torch.utils.checkpoint(use_reentrant=False)` region); every-k (layers 0, k, 2k, ...; k = 2 here); "
        "selective (the attention core alone: eager q k^T to @ v, or the SDPA op); sqrt (ceil(sqrt(n)) "
        "segments, each one region); op-policy (torch selective activation checkpointing per layer, keeping "
        "mm / addmm / bmm / SDPA outputs); offload (`save_on_cpu(pin_memory=True)` per layer). Each is run "
        "for real on the plain-torch reference model (traces/reference/nanogpt.py) and simulated from the same "
        f"scenario: 2 AdamW steps, micro-batch 4, seq 64, exact allocation tracker. {len(results)} of {n_all} "
        f"configs, {seconds:.1f} s on {platform.machine()} ({os.cpu_count()} cores), Python "
        f"{platform.python_version()}. Regenerate with `python bench/validate_checkpointing.py`.", "",
        f"**Summary: {within}/{len(results)} configs within 1% of the measured peak (worst {worst['error']:+.3%}, "
        f"{worst['case'].label}); every forward/backward phase peak within 1% in {phases}/{len(results)}.**", "",
        *per_policy(results), "",
        *validation_table(results), "",
        "What the CPU runs show and what they cannot:", "",
        "- Offload: without CUDA, `save_on_cpu(pin_memory=True)` cannot pin; each saved tensor is copied into a "
        "new CPU tensor as it is saved (one copy per saved variable: a tensor two nodes save, a weight's "
        "transpose, a norm's weight and bias, each autocast weight copy), the original goes with its last "
        "forward use, and backward reads the copy as it is (`.to(\"cpu\")` of a CPU tensor is itself). That "
        "is what the table checks, byte for byte, on the one pool. On a GPU profile the copies live in "
        "`Pool.HOST`, the device keeps only what is not offloaded, and each backward node first copies its "
        "tensors back into device blocks that live for that node; none of that (nor the copy times over the "
        "host link) can be measured here.",
        "- Autocast keeps its 16-bit copies of weights and biases in its cache until the forward ends. Where "
        "nothing saves them (checkpointed or offloaded layers) the forward peak holds every layer's copies; "
        "the replay models that now. It also moved `full` under autocast: its forward-phase peaks were up "
        "to 19% low and are exact now; its overall peaks (in backward) moved by -128 B (the bias copy's "
        "16-bit gradient), and `none` under autocast not at all.",
        "- Forward phases of `full` and `sqrt` (tiny-llama eager, and the 4-layer sqrt) are up to 9.6% low: "
        "in a checkpointed layer's first pass, module arguments and locals (the MLP's input, Llama's q, k, "
        "v and repeated k, v) stay alive until the module returns, and the replay frees them at their last "
        "use. That was so for `full` before; the recompute in backward is higher, so no overall peak here "
        "depends on it. Between the layers of one sqrt segment the caller's loop variable is modelled "
        "(a block's input lives until the block returns).",
        "- Llama under bf16 autocast is not in the table: the tape's rotary embedding and eager softmax dtypes "
        "under autocast differ from the reference model's (fp32 cos/sin promote q and k to fp32), which "
        "leaves `none` itself 9.7% low (eager) before any policy; fixing that is separate work.",
        "- Recompute FLOPs count the ops the cost model gives FLOPs to (matmuls, attention, norms, softmax); "
        "pointwise ops are memory-bound and show in the step time only. op-policy reuses every matmul, so "
        "its recompute is small in FLOPs but not in memory traffic.", "",
        "Simulated only: GPT-2 small, micro-batch 16, seq 1024, bf16-mixed AdamW, one H100-80GB "
        "(`analysis.checkpointing.policy_table`):", "",
        "```", table, "```", "",
        "`optimal_checkpointing` (the least-recompute set of checkpointed layers that fits a budget: per-layer "
        "costs cut from two simulations, dynamic programming over the layer chain, the answer verified by a "
        "full simulation). Budgets at a quarter and three quarters of the way from the all-checkpointed to "
        f"the plain peak; wall time includes every simulation. Brute force on a 4-layer tiny GPT (bf16 "
        f"autocast, CPU profile), all {checks['subsets']} subsets simulated: for {checks['agree']}/"
        f"{checks['budgets']} budgets (every distinct subset peak) the search's set fits and no subset fits "
        "at a lower recompute.", "",
        *search, ""])


def main(argv: list[str]) -> int:
    cases = all_cases()
    n_all = len(cases)
    if "--quick" in argv:
        cases = cases[::3]
    t0 = time.perf_counter()
    results = []
    for case in cases:
        r = run_case(case)
        results.append(r)
        print(f"{r['error']:+8.3%}  {r['worst_phase'].label} {r['worst_phase'].error:+.3%}  {r['seconds']:5.2f}s  "
              f"{case.label}  [{r['unexplained']}]", flush=True)
    seconds = time.perf_counter() - t0
    gpt2 = build_scenario({"preset": "gpt2"}, {"micro_batch": 16, "seq_len": 1024, "precision": "bf16-mixed"})
    table = render_table(policy_table(gpt2), "GiB")
    search, checks = search_checks()
    section = render(results, n_all, seconds, table, search, checks)
    replace_section(SECTION, section)
    print(section.splitlines()[4])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
