"""Host memory (issue 38): the process baseline measured, host bytes of a real CPU run against the simulation, and
the node verdict on Llama-3-8B with its optimizer states offloaded.

    python bench/validate_host.py

1. `import torch` in a fresh Python process, 5 times: its resident set (/proc/self/statm resident pages x page
   size) against analysis/host.py PROCESS_BASELINE. The installed torch is the CPU build: a CUDA process holds more
   (the CUDA runtime and its kernels' host copies), so the figure is a lower bound of a GPU rank's baseline.
2. The reference optimizer-state offload (traces/reference/build.py StateOffload) run for real on the CPU under the
   allocation tracker, against the simulation: host peak (Pool.HOST) measured vs simulated, and the pinned split
   (nothing can be pinned without CUDA: both sides 0 pinned on the cpu profile).
3. `peakledger simulate --preset llama-3-8b --precision bf16 --optimizer-offload states ... --check` with
   --host-memory 48GiB: it fits the H100 but not the pinned limit (half of 48 GiB), exit 1.

Writes the "Host memory and its limits" section of bench/VALIDATION.md (the rest is kept).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import torch
from sections import replace_section  # bench/sections.py, beside this script

ROOT = Path(__file__).resolve().parents[1]

from peakledger import validation  # noqa: E402
from peakledger.analysis.host import PROCESS_BASELINE, host_uses  # noqa: E402
from peakledger.scenario import build_scenario  # noqa: E402

HEADING = "## Host memory and its limits"
RSS = ("import os; r = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'); "
       "a = r(); import torch; print(a, r())")
LLAMA = ["simulate", "--preset", "llama-3-8b", "--precision", "bf16", "--optimizer-offload", "states",
         "--micro-batch", "1", "--seq-len", "2048", "--checkpointing", "full", "--check", "--host-memory", "48GiB"]


def baseline() -> list[int]:
    out = []
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", RSS], capture_output=True, text=True, check=True)
        out.append(int(done.stdout.split()[1]))
    return out


def main() -> int:
    rss = baseline()
    med = int(statistics.median(rss))
    s = build_scenario({"preset": "tiny-mlp"}, {"precision": "fp32", "micro_batch": 2, "steps": 3,
                                                 "optimizer_offload": "states"}, {"device": "cpu"})
    v, measured, simulated = validation.validate(s)
    sim = host_uses(simulated).get(0)
    real = host_uses(measured).get(0)
    done = subprocess.run([str(Path(sys.executable).with_name("peakledger")), *LLAMA], capture_output=True,
                          text=True, cwd=ROOT)
    last = done.stdout.strip().splitlines()[-1]
    lines = [
        HEADING, "",
        "Written by `python bench/validate_host.py` (analysis/host.py, tests/test_host_memory.py).", "",
        f"1. Process baseline: `import torch` (torch {torch.__version__}, the CPU build) in a fresh Python "
        f"{sys.version.split()[0]} process, resident set after the import, 5 runs: "
        f"{', '.join(f'{x:,}' for x in rss)} B; median {med:,} B against PROCESS_BASELINE {PROCESS_BASELINE:,} B "
        f"({(med - PROCESS_BASELINE) / PROCESS_BASELINE:+.2%}). A CUDA process holds more (the CUDA runtime, the "
        "kernels' host copies): not measured here (no GPU), so each rank's baseline is a lower bound.",
        f"2. Host bytes, real CPU run vs simulation (tiny-mlp, fp32, AdamW, `--optimizer-offload states`, 3 steps, "
        f"the tracker's Pool.HOST = the reference StateOffload's host buffers): host peak measured "
        f"{real.peak if real else 0:,} B, simulated {sim.peak if sim else 0:,} B"
        f" ({'exact' if real and sim and real.peak == sim.peak else 'DIFFER'}); pinned measured "
        f"{real.pinned_peak if real else 0:,} B, simulated {sim.pinned_peak if sim else 0:,} B (without CUDA "
        "nothing is pinned: `pin_memory=True` needs a CUDA build; on a GPU profile the same buffers are pinned, "
        "Block.pinned, per the libraries' source below).",
        f"3. `peakledger {' '.join(LLAMA)}`: exit {done.returncode}; its last line:", "", f"       {last}", "",
        "Rules (analysis/host.py): need per node = the sum over its ranks of each rank's host peak (conservative: "
        "the peaks need not coincide) + the baseline per rank; pinned need = the sum of the ranks' pinned peaks; the "
        "pinned limit defaults to half of the node's RAM (a policy: the CUDA driver pins with cuMemHostAlloc / "
        "cuMemHostRegister, not mlock, so `ulimit -l` does not bound it, and the driver API warns that page-locking "
        "excessive amounts degrades the system); host RAM defaults to the profile's DGX node (H100 / H200 / "
        "A100-80GB: 2 TiB, A100-40GB: 1 TiB, 8 GPUs; NVIDIA's DGX datasheets), else the host is judged only with "
        "--host-memory.",
        "Pinned blocks and their sources: the optimizer-state offload's host buffers (models/offload.py; Megatron / "
        "DeepSpeed page-locked offload buffers), save_on_cpu(pin_memory=True) copies (models/replay/offload.py), "
        "DCP async staging copies of >= 5 B (torch 2.13 distributed/checkpoint/_state_dict_stager.py "
        "pin_memory_min_bytes, staging.py StagingOptions.use_pinned_memory=True); pageable: torch.save's and DCP "
        "save's host copies, a loaded state dict, Adam's `step` tensors, the stager's placeholders.",
    ]
    replace_section(HEADING, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
