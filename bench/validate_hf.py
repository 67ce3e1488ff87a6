"""HF transformers' GPT-2 vs the simulator: real CPU training steps on `GPT2LMHeadModel` (random weights,
built from a small GPT2Config, nothing downloaded) against the simulation of the same config.json.

    python bench/validate_hf.py

Each config writes a config.json, reads it back with `--hf-config` semantics (`from_hf_config`:
implementation "hf"), and runs `peakledger.validation.validate` (2 training steps, exact allocation tracker).
"before" is what the describer predicted for the same config before it knew HF's implementation: the
nanoGPT tape of the same fields. Static rows = parameter, gradient and optimizer-state bytes when step
1's optimizer phase ends. Writes the "HF transformers GPT-2" section of bench/VALIDATION.md (the rest is
kept).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time

from sections import replace_section  # bench/sections.py, beside this script

from peakledger import build_scenario
from peakledger.analysis.validate import static_rows
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.timeline import timeline
from peakledger.validation import validate

SECTION = "## HF transformers GPT-2"
TINY = dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
TRAINING = dict(micro_batch=4, seq_len=64, steps=2, optimizer="adamw")
MATRIX = [dict(attention=a, dropout=d, precision=p, checkpointing=c) for a, d, p, c in itertools.product(
    ["eager", "sdpa"], [0.0, 0.1], ["fp32", "bf16-autocast", "bf16"], ["none", "full"])]
EDGE_CASES = [  # edge cases: closed gaps kept as their checks (see the notes under the table)
    dict(attention="eager", dropout=0.0, precision="fp32", checkpointing="full", activation="gelu",
         tied=False, n_inner=96, optimizer="sgd"),
    dict(attention="sdpa", dropout=0.0, precision="fp32", checkpointing="none", micro_batch=3, seq_len=7,
         optimizer="sgd"),
]


@dataclasses.dataclass(frozen=True)
class Case:
    attention: str
    dropout: float
    precision: str
    checkpointing: str
    activation: str = "gelu_new"
    tied: bool = True
    n_inner: int | None = None
    micro_batch: int = TRAINING["micro_batch"]
    seq_len: int = TRAINING["seq_len"]
    optimizer: str = TRAINING["optimizer"]

    @property
    def label(self) -> str:
        extra = "".join([f", {self.activation}" if self.activation != "gelu_new" else "",
                         ", untied" if not self.tied else "", f", n_inner={self.n_inner}" if self.n_inner else "",
                         f", {self.optimizer}" if self.optimizer != TRAINING["optimizer"] else ""])
        return (f"{self.attention}, dropout {self.dropout:g}, {self.precision}, ckpt={self.checkpointing}{extra}, "
                f"B={self.micro_batch} T={self.seq_len}")

    def config_json(self) -> dict:
        rates = {k: self.dropout for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        return {**TINY, **rates, "attn_implementation": self.attention, "activation_function": self.activation,
                "tie_word_embeddings": self.tied, "n_inner": self.n_inner}


def run_case(case: Case) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        with open(path, "w") as f:
            json.dump(case.config_json(), f)
        scenario = build_scenario({"hf_config": path},
                                  {**TRAINING, "micro_batch": case.micro_batch, "seq_len": case.seq_len,
                                   "optimizer": case.optimizer, "precision": case.precision,
                                   "checkpointing": case.checkpointing}, name=case.label)
    t0 = time.perf_counter()
    v, measured, simulated = validate(scenario)
    nanogpt = dataclasses.replace(scenario.model, implementation="nanogpt", activation=None)
    before = timeline(simulate(describe(nanogpt, scenario.setup, "cpu"))).peak().bytes
    phases = [p for p in v.phases if p.label.startswith(("forward", "backward"))]
    worst = max(phases, key=lambda p: abs(p.error))
    m = v.overall.measured
    return {"case": case, "measured": m, "predicted": v.overall.predicted, "error": v.overall.error,
            "before": before, "before_error": (before - m) / m,
            "worst_phase": worst, "static_exact": static_rows(measured) == static_rows(simulated),
            "seconds": time.perf_counter() - t0}


def table(results: list[dict]) -> list[str]:
    lines = ["| config | measured peak B | predicted peak B | error | before (nanoGPT tape) | worst fwd/bwd phase "
             "| static rows exact |", "|---|---:|---:|---:|---:|---|---|"]
    for r in results:
        w = r["worst_phase"]
        lines.append(f"| {r['case'].label} | {r['measured']:,} | {r['predicted']:,} | {r['error']:+.3%} | "
                     f"{r['before']:,} ({r['before_error']:+.1%}) | {w.label} {w.error:+.3%} | "
                     f"{'yes' if r['static_exact'] else 'NO'} |")
    return lines


def render(matrix: list[dict], edges: list[dict], seconds: float) -> str:
    within = sum(abs(r["error"]) <= 0.01 for r in matrix)
    phases = sum(abs(r["worst_phase"].error) <= 0.01 for r in matrix)
    static = sum(r["static_exact"] for r in matrix)
    worst = max(matrix, key=lambda r: abs(r["error"]))
    worst_before = max(matrix, key=lambda r: abs(r["before_error"]))
    return "\n".join([
        SECTION, "",
        "transformers' own `GPT2LMHeadModel` (transformers 5.x, random weights from a small GPT2Config: 2 layers, "
        "n_embd 64, 4 heads, vocab 256, n_positions 64; `use_cache=False` as HF's Trainer trains), simulated from "
        "its config.json (`--hf-config`: implementation \"hf\"). AdamW foreach unless noted, 2 steps, exact "
        f"allocation tracker, {len(matrix) + len(edges)} real CPU runs in {seconds:.1f} s. Regenerate with "
        "`python bench/validate_hf.py`.", "",
        f"**Summary: {within}/{len(matrix)} matrix configs within 1% of the measured peak (worst "
        f"{worst['error']:+.4%}), every forward/backward phase peak within 1% in {phases}/{len(matrix)}, static "
        f"rows exact in {static}/{len(matrix)}. Before (the nanoGPT tape on the same config) the worst error was "
        f"{worst_before['before_error']:+.1%}.**", "",
        *table(matrix), "",
        "Edge cases (the autograd replay in `models/replay/`, shared with the nanoGPT tape):", "",
        *table(edges), "",
        "- Closed. Eager attention, checkpointed, small MLP, where the softmax backward is the peak: q, k and v are "
        "views of the c_attn projection's split, read by different ops (q k^T reads q and k, the copy of v reads v); "
        "torch keeps one head-shaped gradient piece per view (v's from the @ v backward on, q's and k's from the "
        "q k^T backward) and SplitBackward concatenates them into the projection's gradient only when all three "
        "are in. The tape marks those reads as views (`TapeOp.views`) and the replay does the same; it used to "
        "make the full-size projection gradient at v's backward node, holding three times v's piece through the "
        "softmax backward (was +6.1%).",
        "- Closed. Tiny batches (B x T = 21), where the tied embedding's gradient sum is the peak: its two "
        "contributions meet in the AccumulateGrad node's input buffer, which keeps the lm_head contribution "
        "until the embedding backward and then makes a new sum (out of place) before `.grad` takes it; the "
        "replay now does the same (was -5.4%).", ""])


def main() -> int:
    t0 = time.perf_counter()
    results = {"matrix": [], "edges": []}
    for key, cases in (("matrix", MATRIX), ("edges", EDGE_CASES)):
        for kwargs in cases:
            r = run_case(Case(**kwargs))
            results[key].append(r)
            static = "ok " if r["static_exact"] else "BAD"
            print(f"{r['error']:+8.4%}  before {r['before_error']:+7.1%}  static {static}  {r['seconds']:5.2f}s  "
                  f"{r['case'].label}", flush=True)
    section = render(results["matrix"], results["edges"], time.perf_counter() - t0)
    replace_section(SECTION, section)
    print(section.splitlines()[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
