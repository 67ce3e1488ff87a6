"""How fast the compiled describer (models/compile/) predicts a Llama-3-8B-sized training step on this machine:
`peakledger simulate --hf-config CONFIG --compile --precision bf16-autocast --micro-batch 1 --seq-len 4096
--steps 1 --device cpu`, as a user runs it, in a new process with empty caches. Writes the "Compiled describer:
speed" section of bench/RESULTS.md (the other sections are kept).

    python bench/compile_speed.py            # print
    python bench/compile_speed.py --write    # and write the section
    python bench/compile_speed.py --skip-proof --skip-fp32   # quicker

What it runs, each in a process of its own (nothing cached in memory; the GEMM-scratchpad disk cache,
models/compile/workspace.py, pointed at a new empty file by $PEAKLEDGER_GEMM_CACHE):
- cold: the command, wall-clock, from the process's start to its exit; then again with the disk cache that run
  filled (a second prediction on the same machine);
- stages: the same command run in-process (`peakledger.cli.main`) with its stages timed by wrapping them (nothing
  is changed in them): each compile of few layers (`compile_capture`), the rule fitted on the three compiles
  (`depth.fit`: the check), the derivation of all the layers, the wait for the GEMM probes, the conversion to the
  tape, `describe` of the compiled scenario and of the eager one beside it (`simulate --compile` says what compile
  saved), the simulations;
- proof: the capture derived for 8 layers (`--proof-layers`; as `capture_by_depth` derives it: its windows of
  compiles in turn, whatever they cost against the 8 layers') against the compile of all 8 (`compile_capture`),
  through `convert.to_tape`: the same tape (its `held` compared as a set: `to_tape` lists it in the order of a set of
  storage keys, which are the run's storage addresses);
- fp32: the model's GEMM signatures in fp32, run under the profiler as the probes run them: the bytes torch's
  allocator holds in each (MKL/BLAS, not oneDNN: none), what lets `workspace.probed` skip fp32 GEMMs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from sections import replace_section  # bench/sections.py, beside this script

SECTION = "## Compiled describer: speed"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
FLAGS = ["--compile", "--precision", "bf16-autocast", "--micro-batch", "1", "--seq-len", "4096", "--steps", "1",
         "--device", "cpu"]
PROOF_LAYERS = 8  # --proof-layers


def _env(cache: str) -> dict:
    return {**os.environ, "PEAKLEDGER_GEMM_CACHE": cache, "PYTHONWARNINGS": "ignore",
            "PEAKLEDGER_CACHE_DIR": "off"}  # (nor the disk cache of traces: the eager describe beside it traces)


def cold(config_path: str, cache: str) -> dict:
    """The command in a new process: wall-clock seconds, exit status, the report's last lines."""
    exe = os.path.join(os.path.dirname(sys.executable), "peakledger")
    t0 = time.perf_counter()
    proc = subprocess.run([exe, "simulate", "--hf-config", config_path, *FLAGS], env=_env(cache),
                          capture_output=True, text=True)
    return {"seconds": time.perf_counter() - t0, "rc": proc.returncode, "stdout": proc.stdout}


def _child(mode: str, config_path: str, cache: str, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--child-{mode}", config_path, *extra],
                          env=_env(cache), capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"--child-{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


class Stages:
    """Seconds spent inside wrapped functions (outermost calls only) and what they returned, while active."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: list[tuple[str, float, object]] = []
        self._saved: list = []

    def wrap(self, module, attr: str, key: str, note=None):
        fn = getattr(module, attr)
        depth = [0]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            depth[0] += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                depth[0] -= 1
            if not depth[0]:
                dt = time.perf_counter() - t0
                self.seconds[key] = self.seconds.get(key, 0.0) + dt
                self.calls.append((key, dt, note(args, out) if note else None))
            return out

        self._saved.append((module, attr, fn))
        setattr(module, attr, timed)

    def restore(self):
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)


def child_stages(config_path: str) -> dict:
    t_start = time.perf_counter()
    import peakledger.api as api
    import peakledger.models.compile as compiled
    import peakledger.models.compile.convert as convert
    import peakledger.models.compile.depth as depth
    from peakledger.cli import main

    t_import = time.perf_counter() - t_start
    st = Stages()
    st.wrap(depth, "compile_capture", "compile", lambda a, out: len(out.layers))
    st.wrap(depth, "fit", "fit", lambda a, out: sorted(set(out.values())))
    st.wrap(depth, "derive", "derive")
    st.wrap(depth, "rebuild", "rebuild")
    st.wrap(depth, "_resolve", "probes")
    st.wrap(compiled, "cached_capture", "capture")
    st.wrap(convert, "to_tape", "to_tape")
    st.wrap(api, "describe", "describe", lambda a, out: a[1].compile)
    st.wrap(api, "simulate", "simulate")
    sys.argv = ["peakledger", "simulate", "--hf-config", config_path, *FLAGS]
    t0 = time.perf_counter()
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main()
    t_main = time.perf_counter() - t0
    st.restore()
    calls = [(k, dt, n) for k, dt, n in st.calls]
    describes = [(dt, n) for k, dt, n in calls if k == "describe"]
    return {"import": t_import, "main": t_main, "rc": rc, "seconds": st.seconds,
            "compiles": [(n, dt) for k, dt, n in calls if k == "compile"],
            "fits": [n for k, dt, n in calls if k == "fit"],
            "describe_compiled": sum(dt for dt, c in describes if c),
            "describe_eager": sum(dt for dt, c in describes if not c)}


def child_proof(config_path: str, layers: int) -> dict:
    """The capture of `layers` layers derived as `capture_by_depth` derives it (its windows of compiles in turn,
    the first that fits; here whatever the layers compiled in all) against the compile of all of them."""
    from peakledger.models.compile import depth, workspace
    from peakledger.models.compile.capture import compile_capture
    from peakledger.models.compile.convert import to_tape
    from peakledger.models.config import TrainingSetup
    from peakledger.models.traced import from_hf_dict

    data = json.load(open(config_path))
    setup = TrainingSetup(micro_batch=1, seq_len=4096, steps=1, precision="bf16-autocast", compile=True)
    t0 = time.perf_counter()
    caps: dict = {}
    derived, window = None, None
    with workspace.deferred():
        for window in depth.WINDOWS:
            for d in window:
                if d not in caps:
                    caps[d] = compile_capture(from_hf_dict({**data, "num_hidden_layers": d}, "x"), setup)
            derived = depth.from_window(caps, window, layers)
            if derived is not None:
                break
    derived = depth._resolve(derived) if derived is not None else None
    t_derived = time.perf_counter() - t0
    t0 = time.perf_counter()
    whole = compile_capture(from_hf_dict({**data, "num_hidden_layers": layers}, "x"), setup)
    t_whole = time.perf_counter() - t0
    if derived is None:
        return {"layers": layers, "derived": False, "derived_seconds": t_derived, "whole_seconds": t_whole}

    def tape(cap):
        return to_tape(cap, setup, describer="compiled")

    a, b = tape(derived), tape(whole)
    ca, cb = depth.canonical(derived), depth.canonical(whole)
    tokens = [(k, i) for k in cb for i, (x, y) in enumerate(zip(ca[k], cb[k])) if x != y]
    examples = [(k, [depth._string(z) for z in ca[k][i]][:3], [depth._string(z) for z in cb[k][i]][:3])
                for k, i in tokens[:2]]
    # the step simulated on each capture (the compile cache holding it), as the CLI simulates it
    import peakledger.models.compile as compiled
    from peakledger import api
    from peakledger.scenario import Scenario

    model = from_hf_dict({**data, "num_hidden_layers": layers}, "llama-3-8b-sized")
    sims = []
    for cap in (derived, whole):
        compiled._CACHE.clear()
        compiled._CACHE[compiled._key(model, setup)] = cap
        report = api.run(Scenario(name="proof", model=model, setup=setup, device="cpu"))
        sims.append((report.peaks.overall.bytes, [(e.action, e.block.nbytes, e.block.category, e.phase, e.op, e.time)
                                               for e in report.log.events]))
    moved = [i for i, (x, y) in enumerate(zip(sims[0][1], sims[1][1])) if x != y]
    same_instant = all(sims[0][1][i][5] == sims[1][1][i][5] for i in moved)
    return {"layers": layers, "derived": True, "window": window, "equal": a == b, "derived_seconds": t_derived,
            "whole_seconds": t_whole, "canonical_equal": ca == cb, "tokens_differing": len(tokens),
            "tokens": sum(len(v) for v in cb.values()), "examples": examples,
            "ops": len(a.ops), "nodes": len(a.backward), "events": sum(len(p.events) for p in whole.plans),
            "differs": [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)],
            "peaks": [sims[0][0], sims[1][0]], "sim_events": len(sims[1][1]), "sim_moved": len(moved),
            "sim_same_length": len(sims[0][1]) == len(sims[1][1]), "sim_same_instant": same_instant}


def child_fp32(config_path: str) -> dict:
    """Each bf16 GEMM signature of the 3-layer model, in fp32, measured as a probe measures (`_probe`)."""
    import torch

    from peakledger.models.compile import workspace
    from peakledger.models.compile.capture import compile_capture
    from peakledger.models.config import TrainingSetup
    from peakledger.models.traced import from_hf_dict

    data = json.load(open(config_path))
    setup = TrainingSetup(micro_batch=1, seq_len=4096, steps=1, precision="bf16-autocast", compile=True)
    seen: list = []
    original = workspace.measure

    def spy(sig, threads):
        seen.append((sig, threads))
        return original(sig, threads)

    workspace.measure = spy
    try:
        compile_capture(from_hf_dict({**data, "num_hidden_layers": 3}, "x"), setup)
    finally:
        workspace.measure = original
    out = []
    for name, layouts, constants, kwargs, threads in dict.fromkeys(  # K whole: the fp32 GEMMs the model runs
            (sig[0], workspace._cut(sig[0], sig[1]), sig[2], sig[3], threads) for sig, threads in seen):
        fp32 = tuple((size, stride, "torch.float32") for size, stride, _ in layouts)
        t0 = time.perf_counter()
        out.append((name, [x[0] for x in fp32], workspace._probe((name, fp32, constants, kwargs, threads)),
                    time.perf_counter() - t0))
    return {"measured": out, "precision": torch.get_float32_matmul_precision()}


def render(command: str, first: dict, again: dict, stages: dict, proof: dict | None, fp32: dict | None) -> str:
    s = stages["seconds"]
    compiles = ", ".join(f"{n} layers {dt:.1f} s" for n, dt in stages["compiles"])
    checked = (f"checked: `depth.fit` derived the deepest of three compiles from the two others, list by list, "
               f"and found it equal (rules {', '.join(stages['fits'][-1])}), then derived 32 layers"
               if stages["fits"] else "not derived: compiled whole")
    lines = [SECTION, "",
             f"`{command}` on {platform.machine()} ({platform.processor() or 'cpu'}), {os.cpu_count()} cores, "
             f"Python {platform.python_version()}; one run each, wall-clock. The model: a HF `LlamaForCausalLM` "
             "config of Llama-3-8B's sizes (32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab "
             "128256), one training step, micro-batch 1, seq 4096, bf16 autocast, the cpu profile.", "",
             "| run | wall |", "|---|---:|",
             f"| `peakledger simulate --hf-config llama-3-8b-sized.json {' '.join(FLAGS)}`, a new process, empty "
             f"caches | **{first['seconds']:.1f} s** |",
             f"| the same, the GEMM-scratchpad disk cache filled by the run above | {again['seconds']:.1f} s |", "",
             f"Stages of a cold run (the command in-process, a new process, empty caches; import "
             f"{stages['import']:.1f} s, then `main` {stages['main']:.1f} s): compiles in this process {compiles} "
             f"(dynamo, AOTAutograd, inductor codegen on fake tensors, one fake step: {s.get('compile', 0):.1f} s; "
             "the window's deepest compile runs beside them in a forked process, `fork.forked_compile`, on the "
             "other core); "
             f"{checked} (fit {s.get('fit', 0):.2f} s, derivation {s.get('derive', 0) + s.get('rebuild', 0):.2f} s); "
             f"the GEMM probes' remaining wait {s.get('probes', 0):.2f} s (they run in a process of their own "
             f"during the compiles); capture in all {s.get('capture', 0):.1f} s; conversion to the tape "
             f"{s.get('to_tape', 0):.2f} s; `describe` of the compiled scenario {stages['describe_compiled']:.1f} s "
             f"(the capture included) and of the eager one beside it {stages['describe_eager']:.1f} s; simulations "
             f"{s.get('simulate', 0):.1f} s.", ""]
    if proof is not None:
        if proof["derived"]:
            lines.append(f"The derivation proven on the model at {proof['layers']} layers: the capture derived "
                         f"as `capture_by_depth` derives it (from the window {proof['window']}, "
                         f"{proof['derived_seconds']:.1f} s) against the compile of all "
                         f"{proof['layers']} layers ({proof['whole_seconds']:.1f} s, {proof['events']:,} plan events): "
                         f"through `convert.to_tape`, {'the same tape' if proof['equal'] else 'NOT the same tape'} "
                         f"({proof['ops']:,} forward ops, {proof['nodes']:,} backward nodes; the canonical captures, "
                         f"`depth.canonical`: {'equal' if proof['canonical_equal'] else 'NOT equal'})"
                         + (f"; differs in {', '.join(proof['differs'])}: {proof['tokens_differing']} of "
                            f"{proof['tokens']:,} capture tokens, e.g. derived {proof['examples'][0][1]} where the "
                            f"compile has {proof['examples'][0][2]} ({proof['examples'][0][0]})"
                            if proof["differs"] else "") + ". "
                         + f"The step simulated on each (`peakledger.api.run`, the cpu profile): peak "
                         f"{proof['peaks'][0]:,} B derived, {proof['peaks'][1]:,} B compiled; of "
                         f"{proof['sim_events']:,} allocator events {proof['sim_moved']} in another order"
                         + (" within the same instant" if proof["sim_same_instant"] and proof["sim_same_length"]
                            else " (NOT all within one instant)") + ".")
        else:
            lines.append(f"At {proof['layers']} layers the capture was NOT derived (compiled whole).")
        lines.append("")
    if fp32 is not None:
        peaks = sorted({b for *_, b, _ in fp32["measured"]})
        lines.append(f"fp32 GEMMs are not probed: the {len(fp32['measured'])} GEMM signatures of the model (3 "
                     f"layers) in fp32, each run once under the profiler as a probe runs it (float32 matmul "
                     f"precision \"{fp32['precision']}\"), held {', '.join(f'{b:,} B' for b in peaks)} in torch's "
                     f"allocator ({sum(dt for *_, dt in fp32['measured']):.1f} s; M and N cut to 2048 as the "
                     "probes cut them).")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write the section of bench/RESULTS.md")
    ap.add_argument("--skip-proof", action="store_true")
    ap.add_argument("--skip-fp32", action="store_true")
    ap.add_argument("--proof-layers", type=int, default=PROOF_LAYERS, help="the depth the derivation is proven at")
    ap.add_argument("--child-stages")
    ap.add_argument("--child-proof")
    ap.add_argument("--child-fp32")
    args = ap.parse_args()
    for mode, fn in (("stages", child_stages), ("proof", child_proof), ("fp32", child_fp32)):
        path = getattr(args, f"child_{mode}")
        if path:
            print(json.dumps(fn(path, args.proof_layers) if mode == "proof" else fn(path)), flush=True)
            return 0
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "llama-3-8b-sized.json")
        with open(config, "w") as f:
            json.dump(LLAMA_8B, f)
        first = cold(config, os.path.join(tmp, "gemm-1.json"))
        print(f"cold: {first['seconds']:.1f}s rc {first['rc']}", flush=True)
        again = cold(config, os.path.join(tmp, "gemm-1.json"))
        print(f"again (disk cache filled): {again['seconds']:.1f}s rc {again['rc']}", flush=True)
        stages = _child("stages", config, os.path.join(tmp, "gemm-2.json"))
        print(f"stages: {stages}", flush=True)
        proof = None if args.skip_proof else _child("proof", config, os.path.join(tmp, "gemm-3.json"),
                                                    "--proof-layers", str(args.proof_layers))
        print(f"proof: {proof}", flush=True)
        fp32 = None if args.skip_fp32 else _child("fp32", config, os.path.join(tmp, "gemm-4.json"))
        print(f"fp32: {fp32}", flush=True)
    command = "python bench/compile_speed.py --write" + "".join(
        f" --{k.replace('_', '-')}" for k in ("skip_proof", "skip_fp32") if getattr(args, k)) + (
        f" --proof-layers {args.proof_layers}" if args.proof_layers != PROOF_LAYERS else "")
    section = render(command, first, again, stages, proof, fp32)
    print()
    print(section)
    if args.write:
        replace_section(SECTION, section, RESULTS)
        print("wrote the section into bench/RESULTS.md")
    return 0 if first["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
