"""TRL's DPO and GRPO trainers on a tiny random Qwen2: the real CPU run's peak of every RL phase (the truth), and
what `peakledger run` predicts for the same script, phase by phase, each side from its own phases.

The truth is traces/reference/trl_run.py `measure`: examples/scripts/trl_rl.py run as it is under the allocation
tracker, the trainer's own methods wrapped to say which phase runs (its labels, each written on the events as a
schema phase by `LABEL_PHASES`: rollout.score and rollout.reward ROLLOUT, rollout.generate GENERATE,
rollout.ref_logprobs and update.ref_forward REFERENCE, rollout.old_logprobs OLD_LOGPROBS, update.forward FORWARD,
...). The prediction is `peakledger run examples/scripts/trl_rl.py --steps N -- ARGS` (the same script on fake
tensors, recorded and simulated), whose phases are its own: models/script/phases.py wraps TRL's trainer methods
while the script runs. No alignment: each side's events carry their (phase, step); HF generate's PREFILL and DECODE
of the prediction count as GENERATE (the truth does not split generate). A phase's peak is the highest running
total of live bytes while it runs, what is live on entry included.

    python bench/rl_truth.py                  # print the table
    python bench/rl_truth.py --write          # also write bench/rl_truth.json and the section in VALIDATION.md
    python bench/rl_truth.py --cases grpo     # one case
    python bench/rl_truth.py --no-predict     # the truth only

Deterministic: the script fixes its seeds and every length (prompt, chosen, rejected, min_new_tokens =
max_new_tokens); torch.set_num_threads(1) in the measured run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from sections import replace_section  # noqa: E402  (bench/sections.py, beside this script)

from peakledger.simulator.events import Phase  # noqa: E402
from peakledger.simulator.safe_io import write_atomic  # noqa: E402
from peakledger.traces.reference.trl_run import (  # noqa: E402
    SCRIPT,
    TrlCase,
    label_peaks,
    make_model,
    measure,
)

JSON_PATH = os.path.join(HERE, "rl_truth.json")
HEADING = "## RL post-training: TRL's DPO and GRPO trainers, peakledger run's own RL phases"
CASES = {
    "dpo": TrlCase("dpo"),
    "dpo-defaults": TrlCase("dpo", bf16=True, gradient_checkpointing=True),
    "grpo": TrlCase("grpo"),
    "grpo-buffered": TrlCase("grpo", micro_batch=4, grad_accum=2, num_iterations=2),
    "grpo-defaults": TrlCase("grpo", bf16=True, gradient_checkpointing=True),
}
ORDER = list(Phase)
FOLD = {Phase.PREFILL: Phase.GENERATE, Phase.DECODE: Phase.GENERATE}  # the truth labels HF generate as one


def phase_peaks(events) -> dict[tuple[Phase, int], int]:
    """(phase, step) -> the phase's peak, from each event's own phase and step (PREFILL / DECODE as GENERATE)."""
    events = list(events)
    return label_peaks(events, [FOLD.get(e.phase, e.phase) for e in events], [e.step for e in events])


def predict(case: TrlCase, model: str):
    from peakledger.script import ScriptRun, predict_script

    report, _ = predict_script(ScriptRun(str(SCRIPT), tuple(case.argv(model)), steps=case.steps))
    return report


def run_case(name: str, case: TrlCase, model: str, with_prediction: bool) -> dict:
    truth = measure(case, model)
    measured = phase_peaks(truth.log.events)
    row = {"case": name, "argv": case.argv("MODEL"), "measured_peak": truth.peak(), "facts": truth.facts,
           "phases": []}
    predicted = {}
    if with_prediction:
        report = predict(case, model)
        predicted = phase_peaks(report.log.events)
        row["predicted_peak"] = report.peaks.overall.bytes
    for phase, step in sorted(set(measured) | set(predicted), key=lambda k: (k[1], ORDER.index(k[0]))):
        entry = {"phase": phase.value, "step": step}
        for side, peaks in (("measured", measured), ("predicted", predicted)):
            if (phase, step) in peaks:
                entry[side] = peaks[(phase, step)]
        row["phases"].append(entry)
    return row


def _err(p: int | None, m: int | None) -> str:
    return "" if p is None or not m else f"{(p - m) / m * 100:+.3f}%"


def _num(n: int | None) -> str:
    return "" if n is None else format(n, ",")


def table(rows: list[dict]) -> str:
    lines = ["| case | phase | step | measured (B) | predicted (B) | error |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | **overall** | | {r['measured_peak']:,} | "
                     f"{_num(r.get('predicted_peak'))} | {_err(r.get('predicted_peak'), r['measured_peak'])} |")
        for p in r["phases"]:
            m, pred = p.get("measured"), p.get("predicted")
            lines.append(f"| {r['case']} | {p['phase']} | {p['step']} | {_num(m)} | {_num(pred)} | {_err(pred, m)} |")
    return "\n".join(lines)


def section(rows: list[dict]) -> str:
    import torch
    import transformers
    import trl

    args = {r["case"]: " ".join(r["argv"][2:]) for r in rows}
    cases = "; ".join(f"`{k}`: `{v}`" for k, v in args.items())
    return f"""{HEADING}

`python bench/rl_truth.py --write` (trl {trl.__version__}, transformers {transformers.__version__}, torch \
{torch.__version__}; torch.set_num_threads(1)). examples/scripts/trl_rl.py on a tiny random Qwen2 (2 layers, hidden \
64, 4 query / 2 key-value heads, vocab 500; the trainer builds the reference model from the policy's folder), run \
for real under the allocation tracker with the trainer's methods wrapped to name the RL phase \
(traces/reference/trl_run.py); predicted: `peakledger run` of the same script, its events given the measured \
run's phase labels by aligning the two event streams (bench/rl_truth.py). What each phase holds: docs/rl.md. \
Cases: {cases}. The JSON: bench/rl_truth.json.

{table(rows)}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--no-predict", action="store_true")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rl-truth-") as tmp:
        model = os.path.join(tmp, "tiny-qwen2")
        make_model(model)
        rows = [run_case(name, CASES[name], model, not args.no_predict) for name in args.cases]
    print(table(rows))
    if args.write:
        write_atomic(JSON_PATH, (json.dumps(rows, indent=1, sort_keys=True) + "\n").encode())
        replace_section(HEADING, section(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
