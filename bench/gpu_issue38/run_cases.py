"""Record issue 38's cases (cases.py) on one CUDA GPU: peaks per phase and a CUDA memory snapshot per case.

    python bench/gpu_issue38/run_cases.py OUT [--budget-s 480] [--only NAME,NAME] [--max-entries 400000]
    python bench/gpu_issue38/run_cases.py OUT --dry-run      # on a CPU: imports, the plan, a tiny baseline run

Each case runs in its own subprocess (`--case NAME`, a fresh CUDA context and allocator), with the case's timeout,
in cases.py's order, skipped when the budget left is under its timeout. The parent never touches CUDA. Writes:
- OUT/results.json: the GPU, driver, torch / CUDA / transformers / torchao / torchtune / bitsandbytes versions, the
  CUDA context's bytes, and per case: parameters, what building left, per step and phase (forward with the loss,
  backward, optimizer, zero_grad) the peak allocated / reserved (`max_memory_allocated/reserved` after
  `reset_peak_memory_stats()` at the phase's start), allocated / reserved after it, device memory used
  (`mem_get_info`: also what lies outside torch's allocator, e.g. bitsandbytes' managed pages), the host's RSS and
  high-water mark, torch's pinned host allocator stats, the phase's wall time; or the error / timeout.
- OUT/snapshots.tar.gz: NAME.pickle.gz per case, `torch.cuda.memory._snapshot()` of the whole case
  (`_record_memory_history(enabled="all", context=None, stacks="python", max_entries)` started before the model
  is built: nothing pre-existing), rewritten after every case so a cut-off run keeps what it made.
The libraries come from wheels carried with the tree (README.md beside this file): torchtune is not imported as a
package (torchtune 0.6.1's __init__ fails beside torchao 0.18.0, see traces/reference/offload_streams.py); its
training/_activation_offloading.py is loaded as a file, as torchtune's recipes use it.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cases import CASES, LLAMA_3_2_1B, LR, MB, SEQ, STEPS, TINY, ordered  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "zero_grad")


# -- the child: one case -------------------------------------------------------------------------------------------

def versions() -> dict:
    import torch
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    from importlib.metadata import PackageNotFoundError, version
    for name in ("transformers", "torchao", "torchtune", "bitsandbytes", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        out["nvidia_smi"] = smi
    except Exception as e:  # noqa: BLE001
        out["nvidia_smi"] = repr(e)
    return out


def host_now() -> dict:
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    import torch
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None and torch.cuda.is_available():
        try:
            out["pinned"] = {k: v for k, v in stats().items() if "bytes" in k and isinstance(v, int)}
        except Exception as e:  # noqa: BLE001
            out["pinned"] = repr(e)[:200]
    return out


def device_now(cuda: bool) -> dict:
    import torch
    if not cuda:
        return host_now()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
            "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "device_used": total - free, "host": host_now()}


def load_torchtune_offloading() -> types.ModuleType:
    """torchtune 0.6.1's training/_activation_offloading.py as a module, its imports given from their own files
    (tied_linear.py, utils/_logging.py) and torchao's NF4Tensor (the pattern of traces/reference/offload_streams.py,
    here with the real torch.cuda)."""
    import torch
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchtune is not on the path (the .whl-issue38 wheels: README.md)")
    root = Path(next(iter(spec.submodule_search_locations)))

    def load(name, path):
        s = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(s)
        s.loader.exec_module(m)
        return m

    nf4 = None
    for where in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor"):
        try:
            nf4 = importlib.import_module(where).NF4Tensor
            break
        except (ImportError, AttributeError):
            continue
    pkg = types.ModuleType("torchtune")
    pkg.__path__ = []
    modules = types.ModuleType("torchtune.modules")
    modules.TiedLinear = load("issue38_tied_linear", root / "modules" / "tied_linear.py").TiedLinear
    utils = types.ModuleType("torchtune.utils")
    utils.get_logger = load("issue38_tt_logging", root / "utils" / "_logging.py").get_logger
    nf4mod = types.ModuleType("torchao.dtypes.nf4tensor")
    nf4mod.NF4Tensor = nf4 or type("NF4Tensor", (torch.Tensor,), {})
    saved = {k: sys.modules.get(k) for k in ("torchtune", "torchtune.modules", "torchtune.utils",
                                             "torchao.dtypes.nf4tensor")}
    sys.modules.update({"torchtune": pkg, "torchtune.modules": modules, "torchtune.utils": utils,
                        "torchao.dtypes.nf4tensor": nf4mod})
    try:
        return load("issue38_activation_offloading", root / "training" / "_activation_offloading.py")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def build(config: dict, dtype, device: str):
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(**config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    build_mode = "direct"
    if any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
        build_mode = "built in another dtype, then model.to(dtype)"
    return model, build_mode


def make_optimizer(program: dict, model):
    import torch
    name = program["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "torch-adamw":
        return torch.optim.AdamW(params, lr=LR)
    if name.startswith("torchao-"):
        import torchao.optim as ao
        if name == "torchao-CPUOffloadOptimizer":
            return ao.CPUOffloadOptimizer(params, torch.optim.AdamW,
                                          offload_gradients=bool(program.get("offload_gradients")), lr=LR)
        return getattr(ao, name.split("-", 1)[1])(params, lr=LR)
    if name.startswith("bnb-"):
        import bitsandbytes as bnb
        return getattr(bnb.optim, name.split("-", 1)[1])(params, lr=LR)
    raise ValueError(name)


def run_case(name: str, out_dir: Path, max_entries: int, dry: bool) -> dict:
    import torch
    case = CASES[name]
    program = case["program"]
    cuda = not dry
    device = "cuda" if cuda else "cpu"
    res: dict = {"case": name, "program": program, "micro_batch": MB if not dry else 1,
                 "seq_len": SEQ if not dry else 16, "steps": STEPS if not dry else 2, "versions": versions()}
    config = TINY if dry else LLAMA_3_2_1B
    if cuda:
        torch.cuda.init()
        x = torch.empty(1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        res["gpu"] = torch.cuda.get_device_name()
        res["capability"] = list(torch.cuda.get_device_capability())
        res["total_memory"] = total
        res["context_used"] = total - free - torch.cuda.memory_reserved()
        del x
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=max_entries)
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    pg = None
    fsdp = program.get("fsdp2_cpu_offload")
    dtype = torch.float32 if fsdp else torch.bfloat16
    model, res["build"] = build(config, dtype, device)
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29600 + CASES[name]["order"]))
        dist.init_process_group("nccl", rank=0, world_size=1)
        pg = dist
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
    if program.get("fp8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        cfg8 = Float8LinearConfig.from_recipe_name(program["fp8"])  # emulate=False: torch._scaled_mm
        convert_to_float8_training(  # torchtitan's module_filter_fn: dims divisible by 16, not the output head
            model, config=cfg8,
            module_filter_fn=lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0
            and "lm_head" not in fqn)
        res["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    model.train()
    res["n_params"] = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(program, model)
    offload_ctx = None
    if program.get("activation_offload") == "streams":
        mod = load_torchtune_offloading()
        offload_ctx = mod.OffloadActivations(use_pin_memory=cuda, use_streams=True)  # max_fwd_stash_size=5,
        noop = mod.NoOpManager()  # min_offload_size=1024 (defaults); the head under NoOpManager as
        model.lm_head.register_forward_pre_hook(lambda *a: noop.__enter__())  # get_act_offloading_ctx_manager
        model.lm_head.register_forward_hook(lambda *a: noop.__exit__(), always_call=True)
    res["after_build"] = device_now(cuda)
    res["build_s"] = round(time.time() - t0, 2)
    steps = []
    g = torch.Generator().manual_seed(0)
    for step in range(res["steps"]):
        ids = torch.randint(0, config["vocab_size"], (res["micro_batch"], res["seq_len"]), generator=g).to(device)
        rows = {}

        def phase(label, fn, *args):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            value = fn(*args)
            row = device_now(cuda)
            row["seconds"] = round(time.perf_counter() - t, 4)
            rows[label] = row
            return value

        if offload_ctx is not None:  # torchtune: `with ctx: logits = model(tokens)`, the loss outside it
            def fwd(ids):
                with offload_ctx:
                    out = model(input_ids=ids)
                return out, model.loss_function(logits=out.logits, labels=ids, vocab_size=config["vocab_size"])
        else:
            def fwd(ids):
                out = model(input_ids=ids, labels=ids)
                return out, out.loss
        out, loss = phase("forward", fwd, ids)
        phase("backward", loss.backward)
        res.setdefault("loss", []).append(float(loss.detach().float().cpu()))
        del out, loss
        phase("optimizer", opt.step)
        phase("zero_grad", lambda: opt.zero_grad(set_to_none=True))
        del ids
        steps.append(rows)
    res["steps_measured"] = steps
    res["wall_s"] = round(time.time() - t0, 2)
    if cuda:
        stats = torch.cuda.memory_stats()
        res["num_alloc_retries"] = stats.get("num_alloc_retries")
        res["num_ooms"] = stats.get("num_ooms")
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(out_dir / f"{name}.pickle.gz", "wb", compresslevel=6) as f:
            pickle.dump(snap, f)
        res["snapshot_events"] = sum(len(t) for t in snap.get("device_traces", []))
    if pg is not None:
        pg.destroy_process_group()
    return res


def child(name: str, out_dir: Path, max_entries: int, dry: bool) -> int:
    try:
        res = run_case(name, out_dir, max_entries, dry)
        code = 0
    except Exception as e:  # noqa: BLE001
        res = {"case": name, "error": repr(e)[:800], "traceback": traceback.format_exc()[-4000:]}
        code = 1
        try:  # what the case did up to the error (an OOM's snapshot included)
            import torch
            if not dry and torch.cuda.is_initialized():
                snap = torch.cuda.memory._snapshot()
                with gzip.open(out_dir / f"{name}.pickle.gz", "wb", compresslevel=6) as f:
                    pickle.dump(snap, f)
                res["snapshot_after_error"] = True
        except Exception as e2:  # noqa: BLE001
            res["snapshot_error"] = repr(e2)[:300]
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
    return code


# -- the parent: the plan, the budget, the files under OUT ---------------------------------------------------------

def write_outputs(out: Path, work: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(work.glob("*.pickle.gz")):
            tar.add(p, arcname=p.name)
    (out / "snapshots.tar.gz").write_bytes(buf.getvalue())


def summary_line(name: str, res: dict) -> str:
    if "error" in res or "skipped" in res:
        return f"{name}: {res.get('skipped') or res.get('error', '')[:200]}"
    last = res["steps_measured"][-1]
    peaks = " ".join(f"{p} {last[p]['peak_allocated'] / 2**30:.2f}/{last[p]['peak_reserved'] / 2**30:.2f}"
                     for p in PHASES if "peak_allocated" in last[p])
    return f"{name}: last step peak allocated/reserved GiB: {peaks}; {res['wall_s']} s"


def parent(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="issue38-"))
    names = [n for n in ordered() if not a.only or n in a.only.split(",")]
    if a.dry_run and not a.only:  # a CPU runs the others only as far as their CUDA-only parts (--only)
        names = ["baseline-adamw"]
    start = time.time()
    results: dict = {"program": "bench/gpu_issue38/run_cases.py", "cases_file": "bench/gpu_issue38/cases.py",
                     "config": LLAMA_3_2_1B, "micro_batch": MB, "seq_len": SEQ, "steps": STEPS, "lr": LR,
                     "budget_s": a.budget_s, "max_entries": a.max_entries, "dry_run": a.dry_run, "cases": {}}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in names:
        left = a.budget_s - (time.time() - start)
        timeout = CASES[name]["timeout"] if not a.dry_run else 300
        if left < min(timeout, 60):
            results["cases"][name] = {"skipped": f"budget: {left:.0f} s left, case timeout {timeout} s"}
            print(summary_line(name, results["cases"][name]), flush=True)
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), str(work), "--case", name,
               "--max-entries", str(a.max_entries)] + (["--dry-run"] if a.dry_run else [])
        t = time.time()
        try:
            proc = subprocess.run(cmd, env=env, timeout=min(timeout, left), capture_output=True, text=True)
            tail = (proc.stdout + proc.stderr)[-3000:]
            path = work / f"{name}.json"
            res = json.loads(path.read_text()) if path.exists() else {"error": f"no result (rc {proc.returncode})"}
            res["rc"] = proc.returncode
            if proc.returncode:
                res["output_tail"] = tail
        except subprocess.TimeoutExpired as e:
            out_text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            res = {"error": f"timeout after {min(timeout, left):.0f} s", "output_tail": out_text[-2000:]}
        res["subprocess_s"] = round(time.time() - t, 1)
        results["cases"][name] = res
        print(summary_line(name, res), flush=True)
        if a.dry_run:
            print(json.dumps({k: v for k, v in res.items() if k != "traceback"})[:1500], flush=True)
        write_outputs(out, work, results)
    results["total_s"] = round(time.time() - start, 1)
    write_outputs(out, work, results)
    print(f"done in {results['total_s']} s; {out}/results.json, {out}/snapshots.tar.gz", flush=True)
    if a.dry_run:
        print("plan on a GPU (order, timeout s):", ", ".join(f"{n} ({CASES[n]['timeout']})" for n in ordered()))
        print("sum of timeouts:", sum(c["timeout"] for c in CASES.values()), "s; budget", a.budget_s, "s")
        for mod in ("transformers", "torchao", "torchao.float8", "torchao.optim", "bitsandbytes"):
            try:
                importlib.import_module(mod)
                print("import", mod, "ok")
            except Exception as e:  # noqa: BLE001
                print("import", mod, "FAILED:", repr(e)[:200])
        try:
            m = load_torchtune_offloading()
            print("torchtune _activation_offloading loaded:", m.OffloadActivations.__name__)
        except Exception as e:  # noqa: BLE001
            print("torchtune _activation_offloading FAILED:", repr(e)[:200])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--case", help="(internal) run one case in this process, write OUT/NAME.json")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--max-entries", type=int, default=400000)
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: a tiny baseline, imports and the plan")
    a = ap.parse_args(argv)
    if a.case:
        return child(a.case, Path(a.out), a.max_entries, a.dry_run)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
