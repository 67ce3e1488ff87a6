"""HF training programs measured on an H200 against peakledger's default prediction of the same configs.

    python bench/validate_hf_gpu.py [--dir ../shared/gpu-truth/h200/hf-runs] [--only TEXT] [--json] [--write]
                                    [--transformers recorded|installed]

Every run of `../shared/gpu-truth/h200/hf-runs` (its README: an HF model built from `cases.py`'s config, the loop
everyone writes, two steps on one H200, torch 2.11, a CUDA memory snapshot per run) is predicted through the
default path of `peakledger simulate --hf-config`: the config written as config.json, `build_scenario` with the
run's precision, micro-batch, sequence length and options (HF's `gradient_checkpointing_enable` as checkpointing
full; peft LoRA as --lora-r/--lora-alpha/--lora-targets; FSDP2 on one GPU as --dp-engine fsdp2 --world-size 1
with bf16-mixed), AdamW, two steps, on the H200-141GB profile with torch 2.11's rules (`torch_version`).

The program is transformers' own code, so the prediction traces the transformers version that ran (the
snapshots' `measured.json`: 5.17.0): with `--transformers recorded` (the default) a transformers of another
version re-runs this script with that version on its path, installed once with pip into bench/.cache (the
registry is needed once); `--transformers installed` predicts with the installed one (a program that may differ:
transformers 5.25 runs Gemma2 with eager attention and T5 with SDPA, 5.17 the reverse).

Compared, per run (bench/validate_gpu.py `compare_run`, the same reading as the matrix of that script):
- the allocated peak (highest sum of live requested bytes) and the reserved peak of the snapshot
  (bench/gpu_snapshots.py `measured_peaks`) against the prediction's; targets 1% and 2%;
- after every allocation paired by size (the k-th allocation of each size on each side), the reserved bytes;
- at each side's allocated peak, the largest live blocks of a size the other side does not have as often
  ("measured only" / "predicted only", with the predicted tensor's name): where a difference comes from.
The torch.compile runs (`torch.compile(model)`, `--compile`) are predicted where this torch lowers the run's CUDA
program: a CUDA build of torch (the section names its version) seeing an sm 9.0 device (models/compile/gpu.py
`gpu_check`). On a machine without a GPU, bench/fakecuda/run.sh runs this script with a fake CUDA runtime answering
for an H200 (bench/COMPILE_GPU_FINDINGS.md); elsewhere they are listed with the reason, not predicted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
from gpu_snapshots import read_snapshot  # noqa: E402
from sections import replace_section  # noqa: E402
from validate_gpu import TARGETS, compare_run  # noqa: E402

SECTION = "## GPU prediction: HF training programs on an H200 (default path)"
ROOT = BENCH.parent
DEFAULT_DIR = ROOT.parent / "shared" / "gpu-truth" / "h200" / "hf-runs"
CACHE = BENCH / ".cache"
DEVICE, TORCH_RULES = "H200-141GB", "2.11"


def not_predicted(options: dict) -> str | None:
    """Why a run cannot be predicted here (a compile run needs a CUDA build of torch seeing an sm 9.0 device), or
    None."""
    if not options.get("compile"):
        return None
    from peakledger.models.config import ConfigError
    from peakledger.models.devices import device_profile

    try:
        from peakledger.models.compile.gpu import gpu_check

        gpu_check(device_profile(DEVICE).compute_capability)
    except ConfigError as e:
        return f"torch.compile's CUDA program cannot be lowered here ({e}); run under bench/fakecuda/run.sh"
    return None


def load_cases(folder: Path) -> dict:
    """name -> (config, precision, micro_batch, seq_len, options), from the folder's cases.py (data only)."""
    spec = importlib.util.spec_from_file_location("gpu_truth_cases", folder / "cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {**module.CASES, **module.CASES_A2}


def training_of(precision: str, micro_batch: int, seq_len: int | None, options: dict) -> dict:
    """The TrainingSetup fields that say what the run did (module docstring). build "device-fp32": run_cases.py
    builds every model on the GPU in fp32 (`with torch.device("cuda"): cls(cfg)`), then calls `fully_shard` on each
    decoder layer and the root (FSDP2) or `model.to(torch.bfloat16)` (pure bf16), then makes peft's adapters: the
    segments the caching allocator holds when the first step starts are the ones that build left."""
    tr = {"precision": precision, "micro_batch": micro_batch, "optimizer": "adamw", "optimizer_impl": "foreach",
          "steps": 2, "build": "device-fp32"}
    if seq_len:
        tr["seq_len"] = seq_len
    if options.get("checkpointing"):
        tr["checkpointing"] = options["checkpointing"]
    if options.get("lora_r"):
        tr.update(lora_r=options["lora_r"], lora_alpha=options["lora_alpha"],
                  lora_targets=options["lora_targets"].split(","))
    if options.get("fsdp2"):
        tr.update(dp_engine="fsdp2", world_size=1, reduce_dtype="fp32")
    if options.get("compile"):
        tr["compile"] = True
    return tr


def peak_blocks(events) -> list:
    """The blocks live at the highest running total of `events` (an allocated view, in order)."""
    running = best = 0
    at = -1
    for i, e in enumerate(events):
        running += e.delta
        if running > best:
            best, at = running, i
    live: dict = {}
    for e in events[: at + 1]:
        if e.delta > 0:
            live[e.block.id] = e.block
        else:
            live.pop(e.block.id, None)
    return list(live.values())


def unmatched(measured: list, predicted: list, show: int = 4) -> dict:
    """At each side's peak, the live blocks of a size the other side has fewer of, largest total first."""
    cm, cp = Counter(b.nbytes for b in measured), Counter(b.nbytes for b in predicted)
    names: dict[int, list[str]] = {}
    for b in predicted:
        names.setdefault(b.nbytes, []).append(b.name)

    def rows(extra: Counter, named: bool) -> list[dict]:
        out = [{"bytes": size, "count": n, **({"tensors": names[size][-n:][:3]} if named else {})}
               for size, n in extra.items()]
        return sorted(out, key=lambda r: -r["bytes"] * r["count"])[:show]

    return {"measured_only": rows(cm - cp, False), "predicted_only": rows(cp - cm, True),
            "measured_only_bytes": sum(s * n for s, n in (cm - cp).items()),
            "predicted_only_bytes": sum(s * n for s, n in (cp - cm).items())}


def predict(name: str, case: tuple, workdir: Path):
    from peakledger import api
    from peakledger.scenario import build_scenario

    config, precision, micro_batch, seq_len, options = case
    path = workdir / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    scenario = build_scenario({"hf_config": str(path)}, training_of(precision, micro_batch, seq_len, options),
                              {"device": DEVICE, "torch_version": TORCH_RULES}, name=name)
    return api.run(scenario)


def row(name: str, case: tuple, folder: Path, measured_json: dict, workdir: Path) -> dict:
    options = case[4]
    out = {"run": name, "precision": case[1], "micro_batch": case[2], "seq_len": case[3], "options": options,
           "measured_steps": [{k: s[k] for k in ("peak_allocated", "peak_reserved")}
                              for s in measured_json.get("steps", [])]}
    skip = not_predicted(options)
    trace = read_snapshot(folder / f"{name}.pickle.gz")
    if skip:
        from gpu_snapshots import measured_peaks
        return {**out, "measured": measured_peaks(trace), "note": skip}
    t = time.perf_counter()
    report = predict(name, case, workdir)
    out["seconds"] = round(time.perf_counter() - t, 2)
    out["describer"] = report.log.metadata.describer
    out.update(compare_run(trace, report))
    from peakledger.simulator.timeline import timeline
    out["at_peak"] = unmatched(peak_blocks(trace.allocated.events),
                               peak_blocks(timeline(report.log, report.gpu.rank).events))
    return out


def line(r: dict) -> str:
    m = r["measured"]
    if "predicted" not in r:
        return f"{r['run']}: measured allocated {m['allocated']:,} B, reserved {m['reserved']:,} B ({r['note']})"
    p, e = r["predicted"], r["error"]
    return (f"{r['run']}: allocated {m['allocated']:,} / {p['allocated']:,} B ({e['allocated']:+.2%}), reserved "
            f"{m['reserved']:,} / {p['reserved']:,} B ({e['reserved']:+.2%}); {r['describer']}; {r['seconds']} s")


def _blocks(items: list[dict]) -> str:
    return "; ".join(f"{b['count']} x {b['bytes']:,}" + (f" ({b['tensors'][0]})" if b.get("tensors") else "")
                     for b in items) or "-"


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | describer | allocated peak measured / predicted (B) | error | reserved peak measured / "
             "predicted (B) | error | reserved after paired allocs: equal / within 2% / compared | at the peak, "
             "measured only | at the peak, predicted only |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        if "predicted" not in r:
            lines.append(f"| {r['run']} | not predicted: {r['note']} | {m['allocated']:,} / - | - | "
                         f"{m['reserved']:,} / - | - | - | - | - |")
            continue
        p, e, ev, a = r["predicted"], r["error"], r["events"]["reserved"], r["at_peak"]
        lines.append(f"| {r['run']} | {r['describer']} | {m['allocated']:,} / {p['allocated']:,} | "
                     f"{e['allocated']:+.2%} | {m['reserved']:,} / {p['reserved']:,} | {e['reserved']:+.2%} | "
                     f"{ev['equal']} / {ev['within_2pct']} / {r['events']['compared']} | "
                     f"{_blocks(a['measured_only'])} | "
                     f"{_blocks(a['predicted_only'])} |")
    return lines


def summary(rows: list[dict]) -> str:
    done = [r for r in rows if "predicted" in r]
    ok = {k: sum(r["within_target"][k] for r in done) for k in TARGETS}
    both = sum(all(r["within_target"].values()) for r in done)
    return (f"allocated within 1%: {ok['allocated']}/{len(done)}; reserved within 2%: {ok['reserved']}/{len(done)}; "
            f"both: {both}/{len(done)}" + (f" ({len(rows) - len(done)} compile runs not predicted)"
                                           if len(rows) > len(done) else ""))


def _torch_version() -> str:
    import torch

    return torch.__version__


def _compile_note(rows: list[dict]) -> str:
    """How the compile runs were predicted: the running torch's CUDA build lowering for the device it sees (a fake
    H200 under bench/fakecuda/run.sh, which sets PEAKLEDGER_FAKE_CUDA), or why not."""
    compiled = [r for r in rows if r["options"].get("compile")]
    if not compiled or any("predicted" not in r for r in compiled):
        return ""
    seen = "a fake H200 (bench/fakecuda/run.sh)" if os.environ.get("PEAKLEDGER_FAKE_CUDA") else "its GPU"
    return f"; the compile runs lowered by that torch's CUDA build for {seen}, on fake tensors"


def recorded_transformers(folder: Path) -> str | None:
    return json.loads((folder / "measured.json").read_text()).get("transformers")


def rerun_with(version: str, argv: list[str]) -> int:
    """This script again, with transformers `version` (and a huggingface-hub it takes) first on the path."""
    target = CACHE / f"transformers-{version}"
    if not (target / "transformers").is_dir():
        print(f"validate_hf_gpu.py: installing transformers {version} into {target} (the version that ran)",
              file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                        f"transformers=={version}", "huggingface-hub>=1.5,<2.0", "--no-warn-conflicts"], check=True)
        for extra in target.glob("numpy*"):  # the project's numpy stays the one torch was built against
            shutil.rmtree(extra)
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, __file__, *argv, "--transformers", "installed"], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--only", action="append", help="the runs whose name holds the text (repeatable)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write", action="store_true", help=f"write '{SECTION[3:]}' into bench/VALIDATION.md")
    ap.add_argument("--transformers", choices=("recorded", "installed"), default="recorded")
    args = ap.parse_args(argv)
    if not (args.dir / "measured.json").is_file():
        print(f"validate_hf_gpu.py: no measured.json in {args.dir} (the shared GPU truth)", file=sys.stderr)
        return 2
    import transformers
    want = recorded_transformers(args.dir)
    if args.transformers == "recorded" and want and transformers.__version__ != want:
        rest = [a for i, a in enumerate(argv) if a != "--transformers" and (i == 0 or argv[i - 1] != "--transformers")]
        return rerun_with(want, rest)
    measured = json.loads((args.dir / "measured.json").read_text())
    cases = load_cases(args.dir)
    say = (lambda *_: None) if args.json else print
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in cases.items():
            if args.only and not any(o in name for o in args.only):
                continue
            r = row(name, case, args.dir, measured["cases"].get(name, {}), Path(tmp))
            rows.append(r)
            say(line(r))
    text = summary(rows)
    if args.json:
        print(json.dumps({"transformers": transformers.__version__, "recorded": measured.get("transformers"),
                          "summary": text, "runs": rows}, indent=1, default=str))
        return 0
    print(text)
    if args.write:
        replace_section(SECTION, "\n".join([
            SECTION, "",
            f"`python bench/validate_hf_gpu.py --write` (the script's docstring says how each run is predicted and "
            f"compared). The 20 real HF training programs of `../shared/gpu-truth/h200/hf-runs` (torch "
            f"{measured.get('torch')}, transformers {measured.get('transformers')}, one {measured.get('gpu')}), each "
            f"predicted by `peakledger simulate --hf-config` of its config with the run's flags "
            f"on the {DEVICE} profile "
            f"and torch {TORCH_RULES}'s rules, traced with transformers {transformers.__version__}, run with torch "
            f"{_torch_version()}{_compile_note(rows)}. Measured peaks are "
            "the snapshot's requested bytes (allocated) and reserved bytes. Targets: allocated within 1%, reserved "
            f"within 2%. **{text}.**", "", *table(rows), ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
