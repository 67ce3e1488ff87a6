"""How far the two measured sources agree on the same real CPU runs: torch.profiler's memory timeline
(traces/profiler.py) vs our dispatch tracker (traces/tracker/allocation.py). Writes bench/SOURCES.md.

    python bench/sources.py
"""

from __future__ import annotations

import os
import platform

from sections import replace_sections

from peakledger.analysis.sources import agreement
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.traces.profiler import profile_training_steps
from peakledger.traces.reference import build_model, make_batch, make_optimizer
from peakledger.traces.tracker import run_training_steps

CASES = [("tiny-mlp", dict(micro_batch=64, seq_len=1)), ("tiny", dict(micro_batch=2, seq_len=32)),
         ("tiny", dict(micro_batch=2, seq_len=32, optimizer_impl="for-loop")),
         ("tiny-llama", dict(micro_batch=2, seq_len=32, optimizer="sgd-momentum"))]


def run(name, **kw):
    cfg, setup = preset(name), TrainingSetup(**kw)
    logs = []
    for measure in (profile_training_steps, run_training_steps):
        model = build_model(cfg, setup)
        logs.append(measure(model, make_optimizer(model, setup), make_batch(cfg, setup), steps=setup.batch.steps))
    return agreement(*logs)


def main() -> None:
    lines = ["# Sources: two measured sources of memory, and the published figures of the device profiles", "",
             "## Two measured sources: torch.profiler vs the dispatch tracker", "",
             f"Real CPU training runs (fp32, 2 steps), {platform.machine()}, {os.cpu_count()} cores. "
             "Regenerate with `python bench/sources.py`. Bytes at each source's own peak.", "",
             "| run | profiler peak B | tracker peak B | gap B | "
             "categories where the labels differ (profiler / tracker) |",
             "|---|---:|---:|---:|---|"]
    for name, kw in CASES:
        r = run(name, **kw)
        p, t = r["peak"]
        diff = ", ".join(f"{c} {a:,} / {b:,}" for c, (a, b) in r["by_category"].items() if a != b)
        label = f"{name} " + " ".join(f"{k}={v}" for k, v in kw.items())
        lines.append(f"| {label} | {p:,} | {t:,} | {p - t:+,} | {diff or 'none'} |")
    lines += ["", "The profiler sees a few 4-byte scalars that never reach dispatch (the gap). It labels the "
              "AdamW foreach `sqrt` temporaries UNKNOWN and nanoGPT's registered mask buffer INPUT; the tracker "
              "labels them TEMPORARY and BUFFER. Open: on tiny-llama with SGD momentum the profiler-to-EventLog "
              "conversion (traces/profiler.py) ends 16,384 B above torch.profiler's own running sum "
              "(traces/profiler.py profiler_peak gives 1,977,128 B, equal to the tracker): some timeline entries "
              "do not pair CREATE with DESTROY by key; not yet explained."]
    text = "\n".join(lines) + "\n"
    # its own section only: "## GPU device profiles" is kept as written (by hand, with the profiles' sources)
    replace_sections(text, os.path.join(os.path.dirname(os.path.abspath(__file__)), "SOURCES.md"))
    print(text)


if __name__ == "__main__":
    main()
