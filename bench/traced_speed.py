"""How fast the traced describer (models/traced/) is on full-size models: one training step (micro-batch 1,
seq 4096, bf16-mixed, AdamW) of a llama-3-8b-sized and a llama-3-70b-sized HF config, traced on fake
tensors and simulated; next to it, torch's MemTracker under FakeTensorMode on the same 8B-sized model.
Writes the "Traced describer: speed" section of bench/RESULTS.md (the other sections are kept).

    python bench/traced_speed.py            # print
    python bench/traced_speed.py --write    # and write the section
    python bench/traced_speed.py --skip-70b --skip-memtracker   # quicker

Stages of a first `describe` (trace cache empty): model build + trace (`models.traced.recording`: the HF
model built under FakeTensorMode, one micro-batch recorded as the CUDA program of the profile; a model of many
identical layers traced with 3 and 4 layers and derived, models/traced/depth.py), conversion to the tape
(`convert.to_tape`), the op graph (the rest of `describe`); then `simulate`. The stage times are read by wrapping
those two functions for the run (nothing is changed in them; a call made inside another counts once). Then the
derivation is proven on the model itself: the derived recording against the trace of all its layers
(`depth.same`: every op, storage, node, parameter and name equal), with the whole trace's time.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings

from memtracker_step import memtracker_step  # bench/memtracker_step.py, beside this script
from sections import replace_section  # bench/sections.py, beside this script

os.environ["PEAKLEDGER_CACHE_DIR"] = "off"  # the disk cache of traces (models/traced/store.py) would answer "first"

import peakledger.models.traced as trace
import peakledger.models.traced.convert as convert
from peakledger import api
from peakledger.analysis.units import format_bytes, parse_bytes
from peakledger.models.config import TrainingSetup
from peakledger.models.devices import device_profile
from peakledger.models.traced import depth, from_hf_dict
from peakledger.models.training import describe
from peakledger.scenario import Scenario
from peakledger.simulator.engine import simulate
from peakledger.simulator.gcpause import paused_gc
from peakledger.simulator.timeline import timeline

SECTION = "## Traced describer: speed"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
SETUP = TrainingSetup(micro_batch=1, seq_len=4096, steps=1, precision="bf16-mixed", optimizer="adamw")
DEVICE = "H100-80GB"
SEARCH_BUDGET = "240GiB"  # a budget above the 8B's fixed state (bf16-mixed AdamW: ~16 B/param) so the search probes


class Stopwatch:
    """Wall time spent inside `models.traced.recording` and `convert.to_tape` while active."""

    def __init__(self):
        self.seconds = {"trace": 0.0, "convert": 0.0}
        self.calls = {"trace": 0, "convert": 0}

    def wrap(self, key, fn):
        depth = [0]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:  # the outermost call: a derivation's own recordings count inside it
                    self.seconds[key] += time.perf_counter() - t0
                    self.calls[key] += 1
        return timed

    def __enter__(self):
        self._saved = (trace.recording, convert.to_tape)
        trace.recording = self.wrap("trace", trace.recording)
        convert.to_tape = self.wrap("convert", convert.to_tape)
        return self

    def __exit__(self, *exc):
        trace.recording, convert.to_tape = self._saved


def one_model(name: str, config: dict) -> dict:
    model = from_hf_dict(config, name)
    trace._CACHE.clear()
    with Stopwatch() as sw:
        t0 = time.perf_counter()
        graph = describe(model, SETUP, DEVICE)
        t_describe = time.perf_counter() - t0
    t0 = time.perf_counter()
    log = simulate(graph)
    t_sim = time.perf_counter() - t0
    peak = timeline(log).peak().bytes
    with Stopwatch() as sw2:
        t0 = time.perf_counter()
        describe(model, SETUP, DEVICE)
        t_again = time.perf_counter() - t0
    target = (device_profile(DEVICE).compute_capability, "2.6")  # the program describe recorded (its defaults)
    rec = trace.recording(model, SETUP, target)
    t0 = time.perf_counter()
    with paused_gc():  # as describe records
        whole = trace.recording(model, SETUP, target, by_depth=False)
    t_whole = time.perf_counter() - t0
    return {"name": name, "trace": sw.seconds["trace"], "convert": sw.seconds["convert"],
            "whole": t_whole, "derived_equal": depth.same(rec, whole),
            "graph": t_describe - sw.seconds["trace"] - sw.seconds["convert"], "describe": t_describe,
            "simulate": t_sim, "total": t_describe + t_sim, "again": t_again, "again_trace": sw2.seconds["trace"],
            "ops": len(graph), "events": len(log.events), "peak": peak, "aten_ops": len(rec.ops),
            "nodes": len(rec.nodes), "model": model}


def max_batch(model) -> dict:
    scenario = Scenario(name="8b", model=model, setup=SETUP, device=DEVICE)
    before = set(trace._CACHE)
    with Stopwatch() as sw:
        t0 = time.perf_counter()
        best = api.max_micro_batch(scenario, parse_bytes(SEARCH_BUDGET))
        seconds = time.perf_counter() - t0
    new = [k for k in trace._CACHE if k not in before and k[2] == model.digest]  # the model's, not its 3 / 4 layers
    derived = sorted(k[3] for k in new if k in trace._DERIVED)
    return {"best": best, "seconds": seconds, "trace": sw.seconds["trace"], "calls": sw.calls["trace"],
            "new_traces": len(new) - len(derived), "traced": sorted(k[3] for k in new if k not in trace._DERIVED),
            "derived": derived}


def memtracker(config: dict) -> dict:
    """torch's MemTracker on the same model and step (bench/memtracker_step.py), timed by stage."""
    return memtracker_step(config, SETUP.batch.micro_batch, SETUP.batch.seq_len)


def render(results: list[dict], search: dict | None, mt: dict | None, command: str) -> str:
    lines = [SECTION, "",
             f"`{command}` on {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
             "one run, wall-clock. One training step, micro-batch 1, seq 4096, bf16-mixed, AdamW, device profile "
             f"{DEVICE}, of HF `LlamaForCausalLM` configs given as dicts (`from_hf_dict`): llama-3-8b-sized (32 "
             "layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256) and llama-3-70b-sized (80 "
             "layers, hidden 8192, intermediate 28672, 64 heads, 8 KV heads). The first `describe` starts from an "
             "empty trace cache.", "",
             "| model | build + trace | conversion to tape | op graph | describe (first) | simulate | total "
             "| describe again (cached trace) | aten ops / autograd nodes | graph ops | events | peak |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['trace']:.2f} s | {r['convert']:.2f} s | {r['graph']:.2f} s | "
                     f"{r['describe']:.2f} s | {r['simulate']:.2f} s | **{r['total']:.2f} s** | {r['again']:.2f} s "
                     f"(trace {r['again_trace']:.3f} s) | {r['aten_ops']:,} / {r['nodes']:,} | {r['ops']:,} | "
                     f"{r['events']:,} | {format_bytes(r['peak'])} |")
    lines += ["", "The layers derived, not traced (models/traced/depth.py), and proven on each model: its recording "
              "derived from 3 and 4 layers against the trace of all its layers, " + "; ".join(
                  f"{r['name']} {'equal' if r['derived_equal'] else 'NOT EQUAL'} (whole trace {r['whole']:.1f} s)"
                  for r in results) + "."]
    lines.append("")
    if search is not None:
        lines.append(f"Max micro-batch search (`peakledger.api.max_micro_batch`, budget {SEARCH_BUDGET}) on the "
                     f"8B-sized model in the same process: answer {search['best']} in {search['seconds']:.1f} s; "
                     f"{search['calls']} trace-cache lookups ({search['trace']:.1f} s in them): micro-batch "
                     f"{', '.join(map(str, search['traced']))} recorded (each from traces of 3 and 4 layers, "
                     "models/traced/depth.py), "
                     f"{', '.join(map(str, search['derived'])) or 'none'} derived from three traced sizes of one "
                     "program (models/traced/scale.py); a micro-batch of 1 is a program of its own (a size-1 "
                     "dimension spares a reshape's copy), so it is not one of the three.")
        lines.append("")
    if mt is not None:
        if "failed" in mt:
            lines.append(f"torch's MemTracker (`torch.distributed._tools.mem_tracker`) under FakeTensorMode on the "
                         f"8B-sized model (bf16 weights, `no_init_weights`): could not run a step; it failed at "
                         f"{mt['failed']} after {mt['total']:.1f} s.")
        else:
            lines.append(f"torch's MemTracker (`torch.distributed._tools.mem_tracker`) "
                         f"under FakeTensorMode on the same "
                         f"8B-sized model (built with `no_init_weights()` and `dtype=torch.bfloat16`: pure bf16 "
                         f"weights, gradients and AdamW states, no fp32 master copy; one forward + backward + AdamW "
                         f"step): peak {format_bytes(mt['peak'])} ({mt['device']}); build {mt['build']:.1f} s, step "
                         f"{mt['step']:.1f} s, total {mt['total']:.1f} s. It measures one fixed program and "
                         "setting; peakledger's trace is reused for every setting that does not change the "
                         "recording (checkpointing, optimizer, steps, parallelism). peakledger on that setting "
                         "(precision bf16: pure bf16; optimizer_impl for-loop, what AdamW picks for CPU tensors): peak "
                         f"{format_bytes(mt['ours_peak'])} ({mt['ours_peak'] - mt['peak']:+,} B) in "
                         f"{mt['ours_seconds']:.1f} s (describe + simulate; the bf16 trace is the cached one).")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write the section of bench/RESULTS.md")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-memtracker", action="store_true")
    ap.add_argument("--skip-search", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    results = []
    for name, config in ([("llama-3-8b-sized", LLAMA_8B)]
                         + ([] if args.skip_70b else [("llama-3-70b-sized", LLAMA_70B)])):
        r = one_model(name, config)
        results.append(r)
        print(f"{name}: trace {r['trace']:.2f}s convert {r['convert']:.2f}s graph {r['graph']:.2f}s simulate "
              f"{r['simulate']:.2f}s total {r['total']:.2f}s again {r['again']:.2f}s peak {format_bytes(r['peak'])}; "
              f"derived == whole trace: {r['derived_equal']} (whole {r['whole']:.1f}s)", flush=True)
    search = None
    if not args.skip_search:
        search = max_batch(results[0]["model"])
        print(f"max-batch: {search}", flush=True)
    mt = None if args.skip_memtracker else memtracker(LLAMA_8B)
    if mt is not None:  # peakledger on MemTracker's setting: pure bf16 (a new recording: the parameter dtype)
        # torch.optim.AdamW on CPU tensors defaults to its for-loop implementation (foreach only on CUDA-like
        # devices: torch/optim/optimizer.py _default_to_fused_or_foreach), so the same setting is for-loop
        pure = SETUP.replace(precision="bf16", optimizer_impl="for-loop")
        t0 = time.perf_counter()
        # on the cpu profile, as MemTracker ran: tensors only (a GPU profile adds the cuBLAS workspaces, models/gpu.py)
        mt["ours_peak"] = timeline(simulate(describe(results[0]["model"], pure, "cpu"))).peak().bytes
        mt["ours_seconds"] = time.perf_counter() - t0
    if mt is not None:
        print(f"memtracker: {mt}", flush=True)
    command = "python bench/traced_speed.py --write" + "".join(
        f" --{k.replace('_', '-')}" for k in ("skip_70b", "skip_memtracker", "skip_search") if getattr(args, k))
    section = render(results, search, mt, command)
    print()
    print(section)
    if args.write:
        replace_section(SECTION, section, RESULTS)
        print("wrote the section into bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
