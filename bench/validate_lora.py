"""LoRA and QLoRA: real CPU runs of peft-wrapped reference models (and bitsandbytes 4-bit base linears) against
the simulation, and how long the llama-3-8b must-show commands take.

    python bench/validate_lora.py

1. The cases of bench/lora_cases.py REAL_RUNS (tests/test_lora.py asserts them): the tiny Llama and GPT-2
   references wrapped by `peft.get_peft_model` (traces/reference/lora.py), QLoRA with every block linear a
   bitsandbytes `Linear4bit` (nf4, double quantization) on bitsandbytes' CPU backend; 2 AdamW steps, micro-batch 2,
   seq 32, under the exact allocation tracker; measured vs simulated whole-run peak, worst forward/backward phase,
   static rows.
2. `peakledger simulate --preset llama-3-8b --lora-r 16 --lora-targets q_proj,k_proj,v_proj,o_proj --precision
   bf16` (and with `--quantize nf4`) as subprocesses, wall time (best of 3), peak and ledger rows.

Writes the "LoRA and QLoRA (real CPU runs)" section of bench/VALIDATION.md (the rest is kept).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import bitsandbytes
import peft
import torch
from lora_cases import REAL_RUNS, lora_scenario  # bench/lora_cases.py, beside this script
from sections import replace_section  # bench/sections.py, beside this script

ROOT = Path(__file__).resolve().parents[1]

from peakledger.analysis.validate import static_rows  # noqa: E402
from peakledger.validation import validate  # noqa: E402

HEADING = "## LoRA and QLoRA (real CPU runs)"
MUST_SHOW = ["--preset", "llama-3-8b", "--lora-r", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
             "--precision", "bf16"]


def real_runs() -> list[str]:
    rows = ["| case | measured peak (B) | simulated peak (B) | error | worst fwd/bwd phase | static rows |",
            "|---|---:|---:|---:|---:|---|"]
    for case, (preset_name, training) in REAL_RUNS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v, measured, simulated = validate(lora_scenario(preset_name, **training))
        phases = [p for p in v.phases if p.label.startswith(("forward", "backward"))]
        worst = max(phases, key=lambda p: abs(p.error))
        exact = "exact" if static_rows(measured) == static_rows(simulated) else "DIFFER"
        rows.append(f"| {case} | {v.overall.measured:,} | {v.overall.predicted:,} | {v.overall.error:+.4%} | "
                    f"{worst.label} {worst.error:+.4%} | {exact} |")
        print(rows[-1], flush=True)
    return rows


def must_show() -> list[str]:
    import contextlib
    import io

    from peakledger.cli import main as cli_main  # imported once: the in-process time is the command's own work

    rows = ["| command | process wall time (best of 3) | in process, after imports (best of 3) | peak | "
            "parameter.frozen_base | parameter.adapter | gradient (max) "
            "| optimizer states |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    exe = str(Path(sys.executable).with_name("peakledger"))
    for extra in ([], ["--quantize", "nf4"]):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = subprocess.run([exe, "simulate", *MUST_SHOW, *extra, "--json"], check=True, capture_output=True,
                                 text=True).stdout
            times.append(time.perf_counter() - t0)
        inproc = []
        for _ in range(3):
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                cli_main(["simulate", *MUST_SHOW, *extra, "--json"])
            inproc.append(time.perf_counter() - t0)
        data = json.loads(out)
        led = {r["row"]: r for r in data["ledger"]}
        gib = lambda b: f"{b / 2**30:.3f} GiB"  # noqa: E731
        states = sum(r["bytes"] for n, r in led.items() if n.startswith("optimizer_state"))
        rows.append(f"| `peakledger simulate {' '.join(MUST_SHOW + extra)}` | "
                    f"{min(times):.2f} s | {min(inproc):.2f} s | "
                    f"{gib(data['peak']['bytes'])} | {gib(led['parameter.frozen_base']['bytes'])} | "
                    f"{gib(led['parameter.adapter']['bytes'])} | {gib(led['gradient']['max_bytes'])} | {gib(states)} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    torch.set_num_threads(1)
    runs = real_runs()
    cmds = must_show()
    text = "\n".join([
        HEADING, "",
        f"`python bench/validate_lora.py` (torch {torch.__version__}, peft {peft.__version__}, bitsandbytes "
        f"{bitsandbytes.__version__}, {platform.machine()}, {torch.get_num_threads()} thread). The tiny Llama and "
        "GPT-2 reference models wrapped by `peft.get_peft_model` (r 4, alpha 16; QLoRA: every block linear a "
        "bitsandbytes `Linear4bit`, nf4 with double quantization, run by bitsandbytes' CPU backend; its 4-bit matmul "
        "kernel is called as Python, not through the `gemm_4bit` custom op, so that the tracker sees the "
        "dequantized weight it holds: traces/reference/qlora.py), 2 AdamW steps "
        "(one case SGD with momentum), micro-batch 2, seq 32, measured by the exact allocation tracker, against "
        "the simulation (models/lora.py, models/qlora.py). Static rows: parameters, gradients and optimizer states "
        "at the end of step 1's optimizer phase. The same cases (bench/lora_cases.py) are asserted by "
        "tests/test_lora.py (0.5% tolerance). "
        "The tiny Llama's -0.16% under bf16 autocast is the hand-written describer's own gap on that model under "
        "CPU autocast, there without LoRA too (-0.15% in forward and backward).",
        "", *runs, "",
        "The must-show commands (micro-batch 8, seq 1024, 2 steps, H100-80GB): as a process each (Python start and "
        "imports included; `import peakledger` imports torch at present, seconds on this machine, and the 2 cores "
        "are shared with other work), and in process after the imports (describe, simulate, report):", "", *cmds, "",
        "Rows: `parameter.frozen_base` is every base parameter (peft freezes them all: no gradient, no optimizer "
        "state); under nf4 the block linears are packed uint8 (half a byte a weight) plus their quantization state "
        "(8-bit absmax per 64 weights, an fp32 absmax per 256 of those, the offset and both code maps). "
        "`parameter.adapter` is lora_A and lora_B of each targeted linear, fp32 under pure bf16 (peft's "
        "`autocast_adapter_dtype`): the gradient and optimizer rows are theirs alone. Not validated on a GPU: CUDA's "
        "fused 4-bit kernel for <= 4 tokens, and bitsandbytes' per-architecture choice between 5 and 1536 tokens "
        "(peakledger assumes the dequantize-then-matmul path there, as on the CPU and past 1536 tokens).", ""])
    replace_section(HEADING, text)
    print(f"wrote {HEADING!r} to bench/VALIDATION.md")


if __name__ == "__main__":
    main()
