"""Generation and evaluation inside training, predicted by `peakledger run` and measured by real CPU runs.

Each case runs an example script (examples/scripts/hf_generate.py: a tiny random decoder trained one AdamW step,
then `model.generate`; examples/scripts/hf_trainer_eval.py: HF Trainer with `compute_metrics`, so the evaluation
loop keeps every batch's logits) twice: on fake tensors (the prediction, models/script/, simulated) and for real
on the CPU under the allocation tracker (traces/script_run.py), in forked processes. The table gives both peaks,
the peak of the generation's phases (generate's own work, prefill, decode) or the evaluation's, the worst phase's
error, and the KV cache: its largest live bytes in decode on each side beside the bytes worked out by hand from
the config (transformers 5.25 cache_utils.py: DynamicLayer.update concatenates, so the last layer's old values
live beside the new ones for one op; StaticLayer allocates max_cache_len = max_length - 1 at the first update,
generation/utils.py; DynamicSlidingWindowLayer keeps a view of the last window - 1 tokens of the concatenation,
so the prefill's prompt-long storages stay until the first decode step replaces them with window-long ones).
Target (issue 40): the peak and every phase's peak within 0.5%.

    python bench/validate_generation.py            # every case (a few minutes)
    python bench/validate_generation.py --write    # also replace the section in bench/VALIDATION.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from sections import replace_section  # noqa: E402  (bench/sections.py, beside this script)

from peakledger.analysis.validate import compare_logs  # noqa: E402
from peakledger.models.script.child import in_children  # noqa: E402
from peakledger.script import ScriptRun, predict_script  # noqa: E402
from peakledger.simulator.events import Category, EventLog, Phase  # noqa: E402
from peakledger.traces.script_run import measure_script  # noqa: E402

SCRIPTS = Path(ROOT) / "examples" / "scripts"
HEADING = "## Generation and evaluation inside training: peakledger run vs real CPU runs"
GEN, EVAL = "hf_generate.py", "hf_trainer_eval.py"
# the tiny models of hf_generate.py: layers, key/value heads, head dim; Mistral's sliding window
LAYERS, KV_HEADS, HEAD_DIM, WINDOW = 2, 2, 16, 8
BASE = ["--prompts", "2", "--prompt-len", "16", "--max-new-tokens", "8"]
CASES = {  # name -> (script, arguments, what)
    "dynamic-greedy": (GEN, BASE, "DynamicCache, greedy"),
    "dynamic-sample3": (GEN, BASE + ["--do-sample", "--num-return-sequences", "3"],
                        "DynamicCache, sampling, 3 sequences per prompt"),
    "static-greedy": (GEN, BASE + ["--cache", "static"], "StaticCache, greedy"),
    "static-sample2": (GEN, BASE + ["--cache", "static", "--do-sample", "--num-return-sequences", "2"],
                       "StaticCache, sampling, 2 sequences per prompt"),
    "sliding-greedy": (GEN, BASE + ["--model", "mistral-sliding"], "Mistral, sliding window 8, DynamicCache"),
    "dynamic-bf16": (GEN, BASE + ["--dtype", "bf16", "--do-sample", "--num-return-sequences", "2"],
                     "bf16 parameters and cache, sampling, 2 sequences"),
    "eval": (EVAL, ["--eval-batches", "8"], "HF Trainer evaluate, 8 batches, no eval_accumulation_steps"),
    "eval-accum2": (EVAL, ["--eval-batches", "8", "--eval-accumulation-steps", "2"],
                    "the same, eval_accumulation_steps=2"),
}


def _value(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def kv_expected(args: list[str]) -> int | None:
    """The largest KV cache live in decode, worked out by hand (module docstring) from the script's arguments."""
    if "--max-new-tokens" not in args:
        return None
    prompts, p, n = (int(_value(args, f, "0")) for f in ("--prompts", "--prompt-len", "--max-new-tokens"))
    rows = prompts * int(_value(args, "--num-return-sequences", "1"))
    size = 2 if _value(args, "--dtype", "fp32") == "bf16" else 4
    per_token = rows * KV_HEADS * HEAD_DIM * size  # one layer's keys (or values), one token
    if _value(args, "--cache", "dynamic") == "static":
        return LAYERS * 2 * per_token * (p + n - 1)
    if _value(args, "--model", "llama-gqa") == "mistral-sliding":  # (a prompt of at least WINDOW tokens)
        # the prefill's p-token storages stay (views of their last window - 1 tokens) until the first decode step
        # replaces each; the peak: the first layer's new keys and values (window tokens each) beside all of them
        return LAYERS * 2 * per_token * p + 2 * per_token * WINDOW
    return LAYERS * 2 * per_token * (p + n - 1) + per_token * (p + n - 2)


def kv_peak(log: EventLog, phase: Phase = Phase.DECODE) -> int:
    """The largest bytes of KV_CACHE blocks live at once within `phase`."""
    live = best = 0
    for e in log.events:
        if e.block.category is Category.KV_CACHE:
            before, live = live, live + e.delta
            if e.phase is phase:
                best = max(best, before, live)
    return best


def run_case(name: str) -> dict:
    script, args, _ = CASES[name]
    start = time.perf_counter()
    run = ScriptRun(str(SCRIPTS / script), tuple(args))
    report, _ = predict_script(run)
    (measured,) = in_children([(measure_script, (SCRIPTS / script, list(args), None, None, 1, 0, 1, 29541))])
    v = compare_logs(measured, report.log, run.title)
    phases = {p.label.split(" step")[0]: p for p in v.phases}
    wanted = ("generate", "prefill", "decode") if script == GEN else ("eval",)
    worst = max(v.phases, key=lambda p: abs(p.error))
    return {"name": name, "measured": v.overall.measured, "predicted": v.overall.predicted, "error": v.overall.error,
            "phases": {k: (phases[k].measured, phases[k].predicted) for k in wanted if k in phases},
            "worst": (worst.label, worst.error), "kv": (kv_peak(measured), kv_peak(report.log), kv_expected(args)),
            "predictions": max((b for c, b in report.peaks.overall.live_by_category.items()
                                if c is Category.PREDICTIONS), default=0),
            "seconds": time.perf_counter() - start}


def table(rows: list[dict]) -> str:
    lines = ["| case | measured peak (B) | predicted (B) | error | phase peaks measured / predicted (B) | worst "
             "phase | its error | KV cache in decode: measured / predicted / by hand (B) |",
             "|---|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        _, args, what = CASES[r["name"]]
        phases = "; ".join(f"{k} {m:,} / {p:,}" for k, (m, p) in r["phases"].items())
        kv = "-" if r["kv"][2] is None else " / ".join(f"{x:,}" for x in r["kv"])
        lines.append(f"| {r['name']} ({what}) | {r['measured']:,} | {r['predicted']:,} | {r['error']:+.3%} | "
                     f"{phases} | {r['worst'][0]} | {r['worst'][1]:+.3%} | {kv} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="case names, comma-separated")
    p.add_argument("--write", action="store_true", help="replace this section of bench/VALIDATION.md")
    a = p.parse_args()
    names = a.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"--cases: unknown {', '.join(unknown)}; allowed: {', '.join(CASES)}")
    rows = []
    for n in names:
        rows.append(run_case(n))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    import torch
    import transformers

    text = (f"{HEADING}\n\n`python bench/validate_generation.py` (torch {torch.__version__}, transformers "
            f"{transformers.__version__}; {sum(r['seconds'] for r in rows):.0f} s). Each case is an example script "
            "run by `peakledger run` on fake tensors and for real on the CPU under the tracker; the phase peaks "
            "are those of the generation (its own work, prefill, decode) or of the evaluation. Target: peak and "
            "every phase within 0.5%.\n\n" + table(rows) + "\n")
    print(text)
    if a.write:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
