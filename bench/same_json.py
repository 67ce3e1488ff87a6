"""A refactor's proof: the same `--json` bytes before and after, on a fixed set of scenarios.

    python bench/same_json.py --write DIR            # every case's --json into DIR/<case>.json
    python bench/same_json.py --write DIR2 --against DIR   # then: which cases differ, byte for byte
    ... --renamed models/traced/=models/traced/             # a module the outputs cite was renamed
    ... --exe OTHER_TREE/.venv/bin/peakledger --append=--torch-version --append=2.11   # another tree's, a flag more

The cases cover every section of the training setup (batch, precision and optimizer, checkpointing, each
data-parallel engine, the mesh, checkpoint I/O, offload, LoRA / QLoRA, MoE), the describers (hand-written,
HF config, traced module), the CUDA allocator model and the commands that read a run (simulate, explain,
checkpointing, max-batch, where, compare). Each runs as `peakledger` would from a shell, in its own process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT2 = ["--preset", "gpt2", "--micro-batch", "2", "--seq-len", "256"]
TINY = ["--preset", "tiny"]
LLAMA = ["--preset", "tiny-llama"]

CASES: dict[str, list[str]] = {
    # batch and loop
    "default": ["simulate"],
    "tiny-accum": ["simulate", *TINY, "--grad-accum", "3", "--steps", "3"],
    "tiny-forward": ["simulate", *TINY, "--passes", "forward"],
    "tiny-hf-trainer": ["simulate", *TINY, "--loop", "hf-trainer"],
    # precision and optimizer
    "gpt2-bf16-mixed": ["simulate", *GPT2, "--precision", "bf16-mixed", "--device", "H100-80GB"],
    "gpt2-fp16-fp32grads": ["simulate", *GPT2, "--precision", "fp16-mixed", "--fp32-grads"],
    "gpt2-bf16-autocast": ["simulate", *GPT2, "--precision", "bf16-autocast", "--device", "A100-40GB"],
    "llama-bf16-sgd": ["simulate", *LLAMA, "--precision", "bf16", "--optimizer", "sgd-momentum"],
    "tiny-rmsprop-loop": ["simulate", *TINY, "--optimizer", "rmsprop", "--optimizer-impl", "for-loop"],
    "tiny-adagrad": ["simulate", *TINY, "--optimizer", "adagrad"],
    "tiny-adam8bit": ["simulate", *TINY, "--optimizer", "adam-8bit"],
    "tiny-frozen-keep-grads": ["simulate", *TINY, "--freeze", "*wte*", "--no-set-to-none"],
    # activation checkpointing
    "gpt2-full-ckpt": ["simulate", *GPT2, "--checkpointing", "full"],
    "gpt2-every-k": ["simulate", *GPT2, "--checkpointing", "every-k", "--checkpoint-every-k", "3"],
    "gpt2-layers": ["simulate", *GPT2, "--checkpointing", "layers", "--checkpoint-layers", "0,5"],
    "gpt2-selective": ["simulate", *GPT2, "--checkpointing", "selective", "--device", "H100-80GB"],
    # data parallelism
    "gpt2-zero1": ["simulate", *GPT2, "--world-size", "4", "--zero-stage", "1"],
    "gpt2-zero2": ["simulate", *GPT2, "--world-size", "4", "--zero-stage", "2", "--precision", "bf16-mixed"],
    "gpt2-zero3": ["simulate", *GPT2, "--world-size", "8", "--zero-stage", "3", "--device", "H100-80GB"],
    "gpt2-fsdp2": ["simulate", *GPT2, "--world-size", "4", "--dp-engine", "fsdp2", "--precision", "bf16-mixed"],
    "gpt2-fsdp2-keep": ["simulate", *GPT2, "--world-size", "2", "--dp-engine", "fsdp2",
                        "--no-reshard-after-forward", "--reduce-dtype", "fp32"],
    "gpt2-ddp": ["simulate", *GPT2, "--world-size", "2", "--dp-engine", "ddp"],
    # the mesh
    "llama-tp2": ["simulate", *LLAMA, "--world-size", "2", "--tp", "2", "--dp-engine", "fsdp2"],
    "llama-tp2-sp": ["simulate", *LLAMA, "--world-size", "4", "--tp", "2", "--sequence-parallel",
                     "--dp-engine", "fsdp2"],
    "llama-pp2": ["simulate", *LLAMA, "--world-size", "2", "--pp", "2", "--grad-accum", "4"],
    "llama-pp-interleaved": ["simulate", *LLAMA, "--world-size", "2", "--pp", "2", "--grad-accum", "4",
                             "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2"],
    "llama-cp2": ["simulate", *LLAMA, "--world-size", "2", "--cp", "2", "--dp-engine", "fsdp2", "--device", "cpu",
                  "--precision", "fp32"],
    # checkpoint I/O and offload
    "gpt2-save": ["simulate", *GPT2, "--checkpoint-every", "1", "--device", "H100-80GB"],
    "gpt2-save-dcp": ["simulate", *GPT2, "--checkpoint-every", "1", "--save-mode", "sharded", "--world-size", "2",
                      "--dp-engine", "fsdp2"],
    "hf-llama-build-fp32": ["simulate", "--hf-config", "examples/hf-llama-tiny/config.json", "--build",
                            "device-fp32", "--precision", "bf16-mixed", "--world-size", "2", "--dp-engine", "fsdp2"],
    "gpt2-offload": ["simulate", *GPT2, "--optimizer-offload", "states"],
    "gpt2-offload-chunked": ["simulate", *GPT2, "--optimizer-offload", "chunked", "--offload-chunk-params",
                             "20000000"],
    # LoRA, QLoRA, MoE
    "llama-lora": ["simulate", *LLAMA, "--lora-r", "8"],
    "llama-qlora": ["simulate", *LLAMA, "--lora-r", "8", "--quantize", "nf4", "--precision", "bf16"],
    "hf-mixtral-moe": ["simulate", "--hf-config", "examples/hf-mixtral-tiny/config.json", "--moe-routing",
                       "worst"],
    # describers
    "hf-gpt2": ["simulate", "--hf-config", "examples/hf-gpt2-tiny/config.json", "--micro-batch", "2",
                "--seq-len", "64"],
    "hf-llama-ckpt": ["simulate", "--hf-config", "examples/hf-llama-tiny/config.json", "--checkpointing", "full",
                      "--seq-len", "64"],
    "module-cnn": ["simulate", "--module", "examples/modules/cnn.py:factory"],
    "module-lora": ["simulate", "--module", "examples/modules/lora.py:llama"],
    # scenario files
    "scenario-8b-zero3": ["simulate", "--scenario", "examples/llama-3-8b-zero3.toml"],
    "scenario-fsdp2-save": ["simulate", "--scenario", "examples/llama-3-8b-fsdp2-save.toml"],
    # the commands that read a run
    "explain-gpt2": ["explain", *GPT2, "--budget", "2GiB"],
    "checkpointing-gpt2": ["checkpointing", *GPT2, "--budget", "2GiB"],
    "max-batch-gpt2": ["max-batch", "--preset", "gpt2", "--seq-len", "256", "--budget", "4GiB"],
    "where-llama-8b": ["where", "--preset", "llama-3-8b", "--seq-len", "2048", "--precision", "bf16-mixed"],
    "compare-zero": ["compare", "--case", "z0: zero_stage=0", "--case", "z3: zero_stage=3", *GPT2, "--world-size", "4"],
}


def run_case(name: str, args: list[str], out: Path, exe: str | None = None,
             append: tuple[str, ...] = ()) -> tuple[str, int, str]:
    exe = exe or str(Path(sys.executable).with_name("peakledger"))
    done = subprocess.run([exe, *args, *append, "--json"], cwd=ROOT, capture_output=True, timeout=900)
    (out / f"{name}.json").write_bytes(done.stdout)
    (out / f"{name}.rc").write_text(f"{done.returncode}\n{done.stderr.decode(errors='replace')[-2000:]}")
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return name, done.returncode, lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", required=True, help="folder for each case's --json (and .rc: exit status, stderr)")
    ap.add_argument("--against", help="a folder an earlier --write made: print the cases whose bytes differ")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", nargs="*", help="these cases only")
    ap.add_argument("--renamed", action="append", default=[], metavar="OLD=NEW",
                    help="a file the outputs name was renamed: OLD read as NEW in the earlier bytes (repeatable)")
    ap.add_argument("--exe", help="the peakledger to run (default: this Python's)")
    ap.add_argument("--append", action="append", default=[], metavar="ARG",
                    help="an argument added to every case, e.g. --append=--torch-version --append=2.11 (repeatable)")
    args = ap.parse_args()
    out = Path(args.write)
    out.mkdir(parents=True, exist_ok=True)
    cases = {k: v for k, v in CASES.items() if not args.only or k in args.only}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for name, rc, last in pool.map(lambda kv: run_case(*kv, out, args.exe, tuple(args.append)),
                                            cases.items()):
            print(f"{name:24} exit {rc}" + (f"  {last[:100]}" if rc else ""), flush=True)
    if not args.against:
        return 0
    before = Path(args.against)
    renames = [tuple(r.encode().split(b"=", 1)) for r in args.renamed]

    def earlier(name: str) -> bytes:
        data = (before / f"{name}.json").read_bytes()
        for old, new in renames:
            data = data.replace(old, new)
        return data

    differ = [n for n in cases
              if earlier(n) != (out / f"{n}.json").read_bytes()
              or (before / f"{n}.rc").read_text().split("\n")[0] != (out / f"{n}.rc").read_text().split("\n")[0]]
    print(f"{len(cases) - len(differ)} of {len(cases)} cases the same bytes" +
          (f"; differ: {', '.join(differ)}" if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
