"""float8 training and bitsandbytes' 8-bit / paged AdamW on the fake CUDA runtime (bench/fakecuda): the CUDA
programs, which need a GPU, run by a CUDA build of torch on this GPU-less machine, captured as a real GPU capture is
(`peakledger capture --device-kind cuda`: traces/cuda_capture.py, the caching allocator's history) and held against
the simulation of the same scenario on the H200-141GB profile. Run by hand, with its own venv (never the project's):

    python3 -m venv /tmp/cudatorch/.venv
    /tmp/cudatorch/.venv/bin/pip install --isolated torch==2.13.0   # PyPI's CUDA 13.0 build (--isolated: this
    #   machine's pip configuration resolves torch==2.13.0 to a local CPU wheel)
    /tmp/cudatorch/.venv/bin/pip install torchao==0.18.0 bitsandbytes==0.50.2 simpy networkx matplotlib rich pydantic
    /tmp/cudatorch/.venv/bin/pip install --no-deps -e .
    bench/fakecuda/run.sh /tmp/cudatorch/.venv/bin/python bench/validate_fakecuda_lowp.py

What runs for real: torch's CUDA code on the host side (the caching allocator, TensorIterator's output allocation,
the reductions' staging buffers, autograd), torchao's Float8Linear with `emulate=False` (its casts, scales,
`preprocess_addmm` layouts, rowwise post-scale), bitsandbytes' CUDA optimizer code (`get_paged` through
cudaMallocManaged, `prefetch_state`, the fused update's launch). What does not: no kernel runs (the fake runtime
takes every launch and does nothing; values are garbage), and the kernels that call a library needing a driver are
replaced (`fake_kernels`) by their output allocation, shape and strides from the op's meta rule: cuBLAS / cuBLASLt
matmuls (mm, addmm, bmm, torch._scaled_mm) and NVRTC-jitted elementwise ops (exp2, which torchao's rowwise
power-of-2 scale calls). Writes the "float8 and bitsandbytes on the fake CUDA runtime" section of bench/VALIDATION.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import tempfile
import time
from collections import Counter

import torch
from sections import replace_section  # bench/sections.py, beside this script
from validate_float8 import live_at_peak  # the device pool's live set at a phase's peak

from peakledger import build_scenario
from peakledger.analysis.validate import compare_logs
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Category, EventLog, Phase, Pool
from peakledger.traces import cuda_capture

SECTION = "## float8 and bitsandbytes on the fake CUDA runtime"
DEVICE, RULES = "H200-141GB", "2.11"  # the fake runtime's GPU; torch 2.13's allocator rules (cuda_capture.py)
FAKED = ("mm", "addmm", "bmm", "_scaled_mm", "exp2")  # need cuBLAS / cuBLASLt / NVRTC: a driver
WORKSPACES = ("cublas_workspace.", "cublaslt_workspace.")  # made by cuBLAS handles, which no replaced kernel makes
FP8_CASES = [("tiny-mlp", mb, recipe) for mb in (16, 256) for recipe in ("none", "tensorwise", "rowwise")]
BNB_CASES = [("tiny-mlp", 16, "adamw-8bit-bnb"), ("tiny-mlp", 16, "paged-adamw-8bit")]  # plain: FP8_CASES' none


def fake_kernels() -> torch.library.Library:
    """Each FAKED op's CUDA kernel replaced by its output allocation: the op's meta kernel on meta copies of the
    arguments gives the output's shape, strides and dtype; `torch.empty_strided` on the device allocates it through
    the caching allocator, as the real kernel's `at::empty` does. Nothing else the real kernel might allocate (a
    cuBLAS handle's workspace) is made."""
    lib = torch.library.Library("aten", "IMPL")

    def meta(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return type(x)(meta(y) for y in x) if isinstance(x, (list, tuple)) else x

    def replaced(op):
        def kernel(*args, **kwargs):
            out = op(*meta(args), **{k: meta(v) for k, v in kwargs.items()})
            return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="cuda")
        return kernel

    for name in FAKED:
        lib.impl(name, replaced(getattr(torch.ops.aten, name).default), "CUDA")
    return lib


def managed_counts() -> dict:
    """The fake runtime's unified-memory counts (fakecudart.c `fakecudart_managed`)."""
    out = (ctypes.c_size_t * 4)()
    ctypes.CDLL(None).fakecudart_managed(out)
    return dict(zip(("calls", "bytes", "prefetch_to_device", "prefetch_to_host"), out))


def without_workspaces(log: EventLog) -> EventLog:
    return dataclasses.replace(log, events=[e for e in log.events if not e.block.name.startswith(WORKSPACES)])


def training(mb: int, fp8: str = "none", optimizer: str = "adamw") -> dict:
    return dict(precision="bf16", fp8=fp8, optimizer=optimizer, micro_batch=mb, steps=2)


def run_case(preset: str, train: dict) -> dict:
    """Capture the scenario on the fake H200 and simulate it on the H200 profile (torch 2.11's allocator rules,
    every step), the cuBLAS workspaces dropped from the simulation; the optimizer the capture built is kept."""
    scenario = build_scenario({"preset": preset}, train, {"device": DEVICE})
    built = {}
    original = cuda_capture.build_program

    def keep(*a, **k):
        built["program"] = original(*a, **k)
        return built["program"]
    cuda_capture.build_program = keep
    before = managed_counts()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trace = cuda_capture.capture_cuda(scenario, os.path.join(tmp, "snapshot.pickle"))
    finally:
        cuda_capture.build_program = original
    after = managed_counts()
    states = bnb_states(built.pop("program")[1]) if train["optimizer"] != "adamw" else None
    gc.collect()  # this case's program gone before the next capture starts (else it is the next one's
    torch.cuda.empty_cache()  # pre-existing memory)
    graph = describe(scenario.model, scenario.setup, DEVICE, torch_version=RULES, all_steps=True)
    full = simulate(graph, simulator=scenario.simulator)
    simulated = without_workspaces(full)
    v = compare_logs(trace.allocated, simulated, name=scenario.name)
    dropped = sorted({e.block.name for e in full.events if e.block.name.startswith(WORKSPACES)})
    return {"label": f"{preset}, micro-batch {train['micro_batch']}, {train['fp8']}, {train['optimizer']}",
            "key": (preset, train["micro_batch"]), "fp8": train["fp8"], "v": v, "measured": trace.allocated,
            "simulated": simulated, "dropped": dropped,
            "states": states, "managed": {k: after[k] - before[k] for k in after}}


def one_sided(m: dict, s: dict) -> tuple[int, list[str], list[str]]:
    """(blocks paired by size, measured-only names, predicted-only names) of two live sets."""
    a, b = Counter(x.nbytes for x in m.values()), Counter(x.nbytes for x in s.values())
    only = {"m": a - b, "s": b - a}

    def names(blocks, left):
        out = []
        for x in sorted(blocks.values(), key=lambda x: -x.nbytes):
            if left.get(x.nbytes, 0) > 0:
                left[x.nbytes] -= 1
                out.append(f"{x.name} {x.nbytes:,} B")
        return out
    return sum((a & b).values()), names(m, Counter(only["m"])), names(s, Counter(only["s"]))


def bnb_states(optimizer) -> dict:
    """What bitsandbytes made, by where it lives: paged (a CPU tensor over cudaMallocManaged memory, `is_paged`),
    on the CUDA device, elsewhere; bytes and dtypes; and how many tensors are paged."""
    where: dict[str, int] = Counter()
    dtypes: dict[str, set] = {}
    seen = set()  # each storage once: the qmaps are the optimizer's two, shared by every parameter
    for state in optimizer.state.values():
        for key, t in state.items():
            if isinstance(t, torch.Tensor):
                kind = "managed" if getattr(t, "is_paged", False) else t.device.type
                dtypes.setdefault(kind, set()).add(f"{key} {str(t.dtype).removeprefix('torch.')}")
                if t.untyped_storage().data_ptr() in seen:
                    continue
                seen.add(t.untyped_storage().data_ptr())
                where[kind] += t.untyped_storage().nbytes()
    paged = sum(getattr(t, "is_paged", False) for st in optimizer.state.values() for t in st.values())
    return {"bytes": dict(where), "dtypes": {k: sorted(v) for k, v in dtypes.items()}, "paged": paged}


def simulated_rows(log: EventLog) -> dict:
    """The optimizer-state bytes the simulation creates, by pool (managed rows are Pool.HOST, `.managed`)."""
    out: dict[str, int] = Counter()
    for e in log.events:
        if e.action is Action.ALLOC and e.block.category is Category.OPTIMIZER_STATE:
            out["managed" if e.block.name.endswith(".managed") else e.block.pool.value] += e.block.nbytes
    return dict(out)


def phase_rows(r: dict) -> list[str]:
    rows = []
    for p in r["v"].phases:
        if p.label.endswith("step 1") or p.label.endswith("step 2") and p.label.startswith("optimizer"):
            rows.append(f"| {r['label']} | {p.label} | {p.measured:,} | {p.predicted:,} | "
                        f"{p.measured - p.predicted:+,} | {p.error:+.3%} |")
    o = r["v"].overall
    rows.append(f"| {r['label']} | **overall** | {o.measured:,} | {o.predicted:,} | {o.measured - o.predicted:+,} | "
                f"{o.error:+.3%} |")
    return rows


def at_peaks(r: dict) -> list[str]:
    rows = []
    for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        pm, cm = live_at_peak(r["measured"], ph, pool=Pool.DEVICE)
        ps, cs = live_at_peak(r["simulated"], ph, pool=Pool.DEVICE)
        n, om, os_ = one_sided(cm, cs)
        side = "; ".join([f"measured only: {', '.join(om)}"] * bool(om) +
                         [f"predicted only: {', '.join(os_)}"] * bool(os_)) or "none"
        rows.append(f"| {r['label']} | {ph.value} | {n} of {len(cm)} / {len(cs)} | {side} |")
    return rows


def render(fp8: list[dict], bnb: list[dict], seconds: float) -> str:
    head = ["| case | phase peak | measured B | predicted B | measured - predicted | error |",
            "|---|---|---:|---:|---:|---:|"]
    peaks = ["| case | phase (step 1) | blocks paired by size, of measured / predicted live | "
             "alive at the peak on one side only |", "|---|---|---|---|"]
    plain = {r["key"]: r for r in fp8 if r["fp8"] == "none"}
    delta = ["| case | forward peak, float8 - plain: measured / predicted | backward, measured / predicted |",
             "|---|---:|---:|"]
    for r in fp8:
        base = plain[r["key"]]
        if base is r:
            continue
        cells = []
        for label in ("forward step 1", "backward step 1"):
            a = {p.label: p for p in r["v"].phases}[label]
            b = {p.label: p for p in base["v"].phases}[label]
            cells.append(f"{a.measured - b.measured:+,} / {a.predicted - b.predicted:+,}")
        delta.append(f"| {r['label']} | {cells[0]} | {cells[1]} |")
    states = ["| case | bitsandbytes' states by place, B (dtypes) | paged tensors | cudaMallocManaged calls, B | "
              "prefetched to the device / host, B | simulated optimizer states by place, B |",
              "|---|---|---:|---|---|---|"]
    for r in bnb:
        s = r["states"]
        if s is None:
            continue
        place = "; ".join(f"{k}: {b:,} ({', '.join(s['dtypes'][k])})" for k, b in sorted(s["bytes"].items()))
        m = r["managed"]
        sim = "; ".join(f"{k}: {b:,}" for k, b in sorted(simulated_rows(r["simulated"]).items()))
        states.append(f"| {r['label']} | {place} | {s['paged']} | {m['calls']}, {m['bytes']:,} | "
                      f"{m['prefetch_to_device']:,} / {m['prefetch_to_host']:,} | {sim} |")
    rows = fp8 + bnb
    worst = max(abs(r["v"].overall.error) for r in rows)
    worst_phase = max(abs(p.error) for r in rows for p in r["v"].phases)
    fwd_exact = sum(p.measured == p.predicted for r in rows for p in r["v"].phases if p.label == "forward step 1")
    opt_exact = sum(all(p.measured == p.predicted for p in r["v"].phases if p.label.startswith("optimizer"))
                    for r in rows)
    max_gap = max(abs(p.measured - p.predicted) for r in rows for p in r["v"].phases)
    states_same = sum(r["states"]["bytes"].get("cuda", 0) == simulated_rows(r["simulated"]).get("device", 0) and
                      r["states"]["bytes"].get("managed", 0) == simulated_rows(r["simulated"]).get("managed", 0)
                      for r in bnb)
    dropped = sorted({n for r in rows for n in r["dropped"]})
    return "\n".join([
        SECTION, "",
        f"The CUDA programs of `--fp8 tensorwise|rowwise` (torchao 0.18.0 Float8Linear, `emulate=False`: "
        "`torch._scaled_mm`) and `--optimizer adamw-8bit-bnb|paged-adamw-8bit` (bitsandbytes 0.50.2's CUDA "
        "library, libbitsandbytes_cuda130.so) run by torch 2.13.0+cu130 on the fake CUDA runtime (bench/fakecuda: "
        "one H200, sm 9.0), captured as `peakledger capture --device-kind cuda` captures a GPU (traces/cuda_capture.py:"
        " the caching allocator's history, phases from the loop's marks), against the simulation on the H200-141GB "
        f"profile with torch {RULES}'s allocator rules (what `peakledger validate --trace` does with such a capture). "
        "tiny-mlp (3 x Linear(512), no bias), pure bf16, 2 steps. "
        f"{len(rows)} cases, {seconds:.0f} s. Regenerate with "
        "`bench/fakecuda/run.sh /tmp/cudatorch/.venv/bin/python bench/validate_fakecuda_lowp.py` (the venv: the "
        "script's docstring).", "",
        f"**Summary: the overall peak within {worst:.3%} and every phase peak within {worst_phase:.3%} of the "
        f"capture in {len(rows)}/{len(rows)} cases (float8 {len(fp8)}, bitsandbytes {len(bnb)}); forward peaks exact "
        f"in {fwd_exact}/{len(rows)}, optimizer phases exact in {opt_exact}/{len(rows)}; what is left at a phase "
        f"peak: at most {max_gap:,} B: the loss's 2-byte root gradient (neither tape writes it), rowwise's two "
        "4-byte `new_ones(())` scales (torchao float8_ops.py `addmm_float8_unwrapped`), and at the MSE's mean the "
        "CUDA reduction's 64 + 4 B staging buffer (Reduce.cuh; micro-batch 256 without float8, where the forward "
        "peaks at the loss). bitsandbytes' states the same bytes in the same places as the "
        f"simulation's in {states_same}/{len(bnb)}: the paged `state1`/`state2` outside torch's allocator on both "
        "sides (bitsandbytes: CPU tensors over cudaMallocManaged; the simulation: host rows "
        "`<param>.<state>.managed`), the `absmax`es, the small parameters' fp32 states and the two shared qmaps on "
        "the device.**", "",
        "Three simulation rules this run corrected (each now measured here and on a real CPU run): (1) float8's "
        "backward node holds its bf16 grad_output until it returns, through the grad_weight matmul (torchao 0.18.0 "
        "float8_linear.py; rowwise's fp32 post-scale puts the backward peak there: it was 262,144 B under at micro-"
        "batch 256; tests/test_float8_cuda_rules.py); (2) the MLP's `F.mse_loss` returns a 0-dim loss over the whole "
        "unreduced storage, alive while the caller holds `loss`, besides a transient unreduced buffer inside the "
        "kernel (torch 2.13 Loss.cpp `mse_loss_out`; models/transformer/mlp.py: the backward was micro-batch x 512 x "
        "2 B under, with and without float8, on the CPU too); (3) where a Float8Linear's input needs no gradient (the "
        "MLP's first layer) the link between its two replay nodes holds no bytes (it was the weight scale's: "
        "2,048 B too many in rowwise).", "",
        "What it assumes: no kernel runs (values are garbage, so nothing value-dependent is right: no data-dependent "
        "shapes here); the fake runtime answers as an H200 (capability, 150,109,880,320 B, 132 SMs: what torch's "
        "reduction configs and bitsandbytes' `cudaDevAttrConcurrentManagedAccess` read); the replaced kernels "
        f"({', '.join(FAKED)}) allocate their output and nothing else: no cuBLAS / cuBLASLt handle is created, so "
        f"the simulation's handle workspaces ({', '.join(dropped)}: 32 MiB for cuBLAS, 1 MiB for cuBLASLt, made by "
        "the first matmul on each thread) are dropped from the simulated log before comparing, unmeasured here; "
        "`_scaled_mm`'s own rules "
        "(row-major x column-major, dims multiples of 16) are its meta rule's, which is why micro-batch 16, not 2: "
        "`_scaled_mm` refuses the grad_weight gemm of 2 tokens (the CPU emulation runs it; the simulation does not "
        "check it); cuDNN attention is not involved (an MLP). "
        "Paged memory: `get_paged` gets unified memory from cudaMallocManaged (here host memory, counted by the "
        "fake runtime) and wraps it in a *CPU* tensor (`torch.frombuffer`), so torch's CUDA allocator never sees "
        "it, on a GPU as here; `prefetch_state` asks `cudaMemPrefetchAsync` to move it to the device before each "
        "update (counted: to the device / to the host); where it resides, and eviction under pressure, are the "
        "driver's, unmodelled on both sides.", "",
        "### Phase peaks", "", *head, *[x for r in rows for x in phase_rows(r)], "",
        "### What float8 adds (the same scenario without float8 subtracted)", "", *delta, "",
        "### At the peaks", "", *peaks, *[x for r in rows for x in at_peaks(r)], "",
        "### bitsandbytes' states", "", *states, "",
    ])


def main() -> None:
    logging.disable(logging.WARNING)
    lib = fake_kernels()  # kept alive for the run
    t0 = time.time()
    fp8 = [run_case(p, training(mb, fp8=recipe)) for p, mb, recipe in FP8_CASES]
    bnb = [run_case(p, training(mb, optimizer=o)) for p, mb, o in BNB_CASES]
    text = render(fp8, bnb, time.time() - t0)
    del lib
    replace_section(SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
