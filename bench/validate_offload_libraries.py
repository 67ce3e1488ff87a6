"""Optimizer and gradient offload as the libraries do it, vs the simulator: torchao's CPUOffloadOptimizer
(`--optimizer-offload cpu [--offload-gradients]`, models/offload_libraries.py) run for real on the CPU.

    python bench/validate_offload_libraries.py

torchao 0.18.0's own code runs, with the stand-ins of traces/reference/torchao_offload.py for what needs CUDA (its
device check, its stream, pin_memory, record_stream). Per config: 3 training steps under the exact allocation
tracker (`peakledger validate`'s run) with the offload, and the same run without it; and the library's own objects
read after one step (its pinned host copies, its host optimizers' states, the parameters it keeps on the device,
the device gradients left after backward) against the simulated blocks. Writes the section "Optimizer and gradient
offload, as the libraries do it" of bench/VALIDATION.md (appended at the end; the rest is kept).
"""

from __future__ import annotations

import platform
import sys
import time

import torch
from sections import replace_section  # bench/sections.py, beside this script

from peakledger import build_scenario
from peakledger.analysis.report import step_ends
from peakledger.api import op_graph, run
from peakledger.models.offload_libraries import is_pinned
from peakledger.simulator.events import Category, Phase, Pool
from peakledger.traces.reference import autocast_context, build_model, make_batch, optimizer_class
from peakledger.traces.reference.torchao_offload import TorchaoOffload
from peakledger.validation import validate

SECTION = "## Optimizer and gradient offload, as the libraries do it"
PRESETS = {"tiny": ["fp32", "bf16-autocast", "bf16"], "tiny-llama": ["fp32", "bf16"], "tiny-mlp": ["fp32", "bf16"]}
OPTIMIZERS = ["adamw", "amsgrad"]
GPU_BASE = dict(precision="bf16", seq_len=8192, micro_batch=1, checkpointing="full", optimizer="adamw",
                optimizer_impl="fused", steps=3)


def training(preset: str, optimizer: str, precision: str, mode: str, gradients: bool, grad_accum: int = 1) -> dict:
    out = dict(micro_batch=2, steps=3, optimizer=optimizer, optimizer_impl="fused", precision=precision)
    if grad_accum > 1:
        out["grad_accum"] = grad_accum
    if preset != "tiny-mlp":
        out["seq_len"] = 32
    if mode != "none":
        out["optimizer_offload"] = mode
    if gradients:
        out["offload_gradients"] = True
    return out


def library_objects(scenario) -> dict:
    """One real step of torchao's CPUOffloadOptimizer over the reference model; what its own objects hold."""
    setup, cfg = scenario.setup, scenario.model
    model = build_model(cfg, setup)
    cls, kwargs = optimizer_class(setup)
    opt = TorchaoOffload([p for p in model.parameters() if p.requires_grad], setup, cls, kwargs).optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    inputs = make_batch(cfg, setup)[0]
    with autocast_context(setup):
        _, loss = model(*inputs)
    loss.backward()
    grads_left = sorted(names[id(p)] for p in model.parameters() if p.grad is not None)
    opt.step()
    host_states = sum(v.untyped_storage().nbytes() for p_dev, o in opt.optim_dict.items()
                      for v in o.state[opt.param_d2h_map[p_dev]].values() if isinstance(v, torch.Tensor))
    return {"pinned": sum(h.untyped_storage().nbytes() + h.grad.untyped_storage().nbytes()
                          for h in opt.param_d2h_map.values()),
            "host_states": host_states,
            "on_device": sorted(names[id(p)] for g in opt.d_param_groups for p in g["params"]),
            "grads_left": grads_left}


def simulated_objects(scenario) -> dict:
    """The same read from the simulated blocks: live at the end of step 1's backward, and once step 1 is done."""
    ops = [op for op in op_graph(scenario).ops_in_order() if op.step <= 1]
    live: dict[int, object] = {}
    grads_left = None
    for op in ops:
        if grads_left is None and op.phase is Phase.OPTIMIZER:
            grads_left = sorted(b.name[: -len(".grad")] for b in live.values()
                                if b.category is Category.GRADIENT and b.pool is Pool.DEVICE)
        for b in op.allocs:
            live[b.id] = b
        for f in op.frees:
            live.pop(f, None)
    host = [b for b in live.values() if b.pool is Pool.HOST]
    device_states = {b.name.rsplit(".", 1)[0] for b in live.values()
                     if b.category is Category.OPTIMIZER_STATE and b.pool is Pool.DEVICE}
    return {"pinned": sum(b.nbytes for b in host if is_pinned(b)),
            "host_states": sum(b.nbytes for b in host if b.category is Category.OPTIMIZER_STATE),
            "on_device": sorted(device_states), "grads_left": grads_left}


def gaps(v, prefixes) -> dict[str, int]:
    return {p.label: p.predicted - p.measured for p in v.phases if p.label.startswith(prefixes)}


def pair(p) -> str:
    return f"{p.measured:,} / {p.predicted:,}"


def backward(v) -> object:
    return max((p for p in v.phases if p.label.startswith("backward")), key=lambda p: p.measured)


def run_case(preset: str, optimizer: str, precision: str, gradients: bool, plain, grad_accum: int = 1) -> dict:
    scenario = build_scenario({"preset": preset}, training(preset, optimizer, precision, "cpu", gradients, grad_accum),
                              {"device": "cpu"})
    v, _, _ = validate(scenario)
    lib, sim = library_objects(scenario), simulated_objects(scenario)
    return {"label": f"{preset}, {optimizer} fused, {precision}" + (", offload_gradients" if gradients else "")
            + (f", grad_accum {grad_accum}" if grad_accum > 1 else ""),
            "v": v, "plain": plain, "lib": lib, "sim": sim,
            "optimizer_exact": all(g == 0 for g in gaps(v, ("optimizer", "zero_grad")).values()),
            "host_exact": v.host is not None and v.host.measured == v.host.predicted,
            "other_same": gaps(v, ("load", "forward", "backward")) == gaps(plain, ("load", "forward", "backward")),
            "objects_exact": lib == sim}


def cpu_table(rows: list[dict]) -> list[str]:
    lines = ["| config | device peak, measured / predicted B | backward peak, measured / predicted B (without "
             "the offload) | host peak, measured / predicted B | pinned host B, torchao's objects / simulated | "
             "host states B, torchao's / simulated | device gradients left after backward, torchao / simulated | "
             "optimizer phases | load/fwd/bwd gaps as without |", "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        v, lib, sim = r["v"], r["lib"], r["sim"]
        lines.append(
            f"| {r['label']} | {pair(v.overall)} | {pair(backward(v))} ({backward(r['plain']).measured:,}) | "
            f"{pair(v.host)} | {lib['pinned']:,} / {sim['pinned']:,} | {lib['host_states']:,} / "
            f"{sim['host_states']:,} | {len(lib['grads_left'])} / {len(sim['grads_left'])}"
            f"{'' if lib['grads_left'] == sim['grads_left'] else ' (NAMES DIFFER)'} | "
            f"{'exact' if r['optimizer_exact'] else 'DIFFER'} | {'yes' if r['other_same'] else 'NO'} |")
    return lines


def pinned_bytes(graph) -> int:
    """Rank 0's pinned host bytes made by the load and the first step (gradients are made again each step)."""
    return sum(b.nbytes for op in graph.ops_in_order() if op.step <= 1 for b in op.allocs
               if b.rank == 0 and is_pinned(b))


def gpu_table() -> list[str]:
    lines = ["| llama-3-8b, pure bf16, AdamW fused, 1 x H100-80GB, seq 8192, full ckpt (simulated) | device peak | "
             "host peak | of it torchao's pinned buffers | steady step time |", "|---|---:|---:|---:|---:|"]
    gib = 2**30
    for label, extra in (("no offload", {}), ("optimizer_offload states (the generic wrapper)",
                                              dict(optimizer_offload="states")),
                         ("optimizer_offload cpu (torchao)", dict(optimizer_offload="cpu")),
                         ("optimizer_offload cpu, offload_gradients (torchao)",
                          dict(optimizer_offload="cpu", offload_gradients=True))):
        scenario = build_scenario({"preset": "llama-3-8b"}, dict(GPU_BASE, **extra), {"device": "H100-80GB"})
        graph = op_graph(scenario)
        report = run(scenario, graph=graph)
        pinned = pinned_bytes(graph)
        ends = step_ends(report.log)[0]
        lines.append(f"| {label} | {report.peaks.overall.bytes / gib:.2f} GiB | "
                     f"{report.host.overall.bytes / gib if report.host else 0:.2f} GiB | "
                     f"{f'{pinned / gib:.2f} GiB' if 'torchao' in label else '-'} | "
                     f"{ends[3] - ends[2]:.2f} s |")
    return lines


def fsdp_table() -> list[str]:
    """FSDP2 with and without CPUOffloadPolicy, simulated (rank 0)."""
    lines = ["| llama-3-8b, bf16-mixed, AdamW fused, FSDP2 x 8 H100-80GB, seq 8192, full ckpt (simulated, rank 0) | "
             "device peak | host peak | of it pinned | steady step time |", "|---|---:|---:|---:|---:|"]
    gib = 2**30
    for label, extra in (("fully_shard", {}), ("fully_shard, CPUOffloadPolicy(pin_memory=True)",
                                               dict(fsdp_cpu_offload=True))):
        scenario = build_scenario({"preset": "llama-3-8b"}, dict(GPU_BASE, precision="bf16-mixed", dp_engine="fsdp2",
                                                                 world_size=8, **extra), {"device": "H100-80GB"})
        graph = op_graph(scenario)
        report = run(scenario, graph=graph)
        ends = step_ends(report.log)[0]
        pinned = pinned_bytes(graph)
        lines.append(f"| {label} | {report.peaks.overall.bytes / gib:.2f} GiB | "
                     f"{report.host.overall.bytes / gib if report.host else 0:.2f} GiB | {pinned / gib:.2f} GiB | "
                     f"{ends[3] - ends[2]:.2f} s |")
    return lines


def zero_table() -> list[str]:
    """DeepSpeed ZeRO-2 with and without ZeRO-Offload, simulated (rank 0)."""
    lines = ["| llama-3-8b, bf16-mixed, AdamW, DeepSpeed ZeRO-2 x 8 H100-80GB, seq 8192, full ckpt (simulated, rank 0) "
             "| "
             "device peak | host peak | of it pinned | steady step time |", "|---|---:|---:|---:|---:|"]
    gib = 2**30
    for label, extra in (("ZeRO-2", {}), ("ZeRO-2, offload_optimizer: {device: cpu, pin_memory: true}",
                                          dict(zero_offload_optimizer="cpu"))):
        scenario = build_scenario({"preset": "llama-3-8b"}, dict(GPU_BASE, precision="bf16-mixed", zero_stage=2,
                                                                 world_size=8, **extra), {"device": "H100-80GB"})
        graph = op_graph(scenario)
        report = run(scenario, graph=graph)
        ends = step_ends(report.log)[0]
        pinned = sum(b.nbytes for op in graph.ops_in_order() for b in op.allocs if b.rank == 0
                     and b.pool is Pool.HOST and b.category is not Category.OPTIMIZER_STATE)
        lines.append(f"| {label} | {report.peaks.overall.bytes / gib:.2f} GiB | "
                     f"{report.host.overall.bytes / gib if report.host else 0:.2f} GiB | {pinned / gib:.2f} GiB | "
                     f"{ends[3] - ends[2]:.2f} s |")
    return lines


def render(rows: list[dict], seconds: float) -> str:
    n = len(rows)
    count = {k: sum(r[k] for r in rows) for k in ("optimizer_exact", "host_exact", "other_same", "objects_exact")}
    kept = {r["label"]: r for r in rows if "offload_gradients" not in r["label"]}
    freed = [(r, kept[r["label"].removesuffix(", offload_gradients")]) for r in rows if r["label"] not in kept]
    lower = [(r, k) for r, k in freed if backward(r["v"]).measured < backward(k["v"]).measured]
    same = sum(backward(k["v"]).predicted - backward(r["v"]).predicted ==
               backward(k["v"]).measured - backward(r["v"]).measured for r, k in freed)
    return "\n".join([
        SECTION, "",
        "torchao 0.18.0 `torchao.optim.CPUOffloadOptimizer` (torchao/optim/cpu_offload.py; `--optimizer-offload cpu "
        "[--offload-gradients]`, models/offload_libraries.py) run for real on the CPU: the library's own code, with "
        "the stand-ins of traces/reference/torchao_offload.py for what needs CUDA (its device check, its copy "
        "stream, `pin_memory=True`, `record_stream`; on a CPU the copies run at once). 3 steps, micro-batch 2, seq "
        f"32 (grad_accum 1, and 2 in the last rows), fused AdamW / AMSGrad (torchao's default makes AdamW fused), "
        f"exact allocation tracker; {n} configs, each "
        f"also run without the offload, and one step each reading torchao's objects; {seconds:.1f} s on "
        f"{platform.machine()}, torch {torch.__version__}. The library's host tensors (`p_host`, `p_host.grad`, the "
        "host optimizers' states) are host memory on both sides; \"device\" is everything else, what a GPU would "
        "hold. Regenerate with `python bench/validate_offload_libraries.py`.", "",
        f"**Summary: host peak exact in {count['host_exact']}/{n}; optimizer and zero_grad phase peaks exact in "
        f"{count['optimizer_exact']}/{n}; load/forward/backward phases off by exactly what the run without the "
        f"offload is off in {count['other_same']}/{n}; torchao's own objects (pinned host bytes, host state bytes, "
        f"the parameters it keeps on the device, which device gradients are left after backward) equal to the "
        f"simulation's in {count['objects_exact']}/{n}. offload_gradients lowers the measured backward peak in "
        f"{len(lower)}/{len(freed)} configs ({', '.join(sorted({r['label'].split(',')[0] for r, _ in lower}))}: "
        "the backward peak comes once the gradients exist; in the others it comes earlier, at the logits' "
        f"gradient, before most parameter gradients are made), the simulation by the same bytes in {same}/"
        f"{len(freed)}.**", "",
        "The rules (torchao/optim/cpu_offload.py, 0.18.0): parameters with fewer than `minimal_size` = 4096 elements "
        "stay with an on-device optimizer (`d_opt`, states on the device); each other parameter gets two pinned host "
        "buffers in its own dtype (`p_host`, `p_host.grad`, made in the constructor, kept), a post-accumulate-grad "
        "hook that copies its gradient to the host on a side stream (and with `offload_gradients` drops the device "
        "gradient at once: `record_stream` + `p.grad = None`), and an optimizer of its own over `p_host`, whose "
        "states torch makes lazily on the host at the first step (pageable: `zeros_like` of a pinned tensor is not "
        "pinned). `step()`: `d_opt.step()`, then per parameter in the hooks' order: wait for its gradient's copy, "
        "the host step, the parameter copied back in place; `stream.synchronize()`. `zero_grad()` drops device "
        "gradients only.", "",
        *cpu_table(rows), "",
        "What it means on a GPU (simulated; H100-80GB profile; host link 50 GB/s assumed, the host step at the "
        "cost model's CPU memory bandwidth (20 GB/s, assumed) over the 7 parameter-sized tensors a fused Adam "
        "step reads and writes; the gradient copies overlap backward on the offload stream; steady step time = "
        "the end of step 3 less the end of step 2, a step's end being its last memory event: `time_per_step_s`, "
        "the run's last event over its steps, misses the last step's host steps when they allocate nothing, as "
        "with offload_gradients here):", "",
        *gpu_table(), "",
        "- Not shown by a CPU run: pinning (there is no pinned allocator without CUDA: the stand-in makes the same "
        "bytes pageable; the simulation marks `p_host` and `p_host.grad` pinned, models/offload_libraries.py "
        "`is_pinned`), the copies' overlap and the caching allocator's reuse of a gradient block only after its "
        "`record_stream`ed copy ends (the simulation frees it when the hook drops it, as `memory_allocated` sees "
        "it). The timing is the cost model's.",
        "",
        "FSDP2's `CPUOffloadPolicy(pin_memory=True)` (`--fsdp-cpu-offload`, torch 2.13 torch/distributed/fsdp/"
        "_fully_shard/_fsdp_param.py and _fsdp_collectives.py; models/parallel/fsdp.py), simulated only: "
        "`_init_sharded_param` moves each padded shard to pinned host memory; `all_gather_inputs` copies each "
        "shard to the device (`.to(device, non_blocking=True)`, no foreach fast path under offload), casts it to "
        "the param_dtype where it differs, and the inputs go once the all-gather is issued; `foreach_reduce` "
        "copies each parameter's view of the reduce-scatter output to the host (pinned the first time; a pageable "
        "copy summed in and dropped when accumulating) and drops the device output; the optimizer, over CPU "
        "parameters, makes its states on the host and steps there (fused Adam, at the cost model's CPU bandwidth, "
        "assumed). `peakledger validate --world-size N --fsdp-cpu-offload` is refused: on a CPU the policy's copies "
        "are the tensors themselves (`.to(cpu)` of a CPU tensor), so a CPU run cannot show them; "
        "tests/test_offload_libraries.py holds the simulation to the source's formulas (host bytes per rank, "
        "the copies' dtypes, sizes and count).", "",
        *fsdp_table(), "",
        "DeepSpeed ZeRO-Offload (`--zero-offload-optimizer cpu`, zero_optimization.offload_optimizer.device cpu, "
        "pin_memory true; deepspeed 0.19.8 runtime/zero/stage_1_and_2.py `cpu_offload`; models/parallel/"
        "deepspeed.py), stage 2, simulated only (DeepSpeed needs CUDA here): at init the fp32 partition cloned to "
        "pinned host memory with a pinned bit16 buffer of its size, `temp_grad_buffer_for_cpu_offload` (host, "
        "pinned) and `temp_grad_buffer_for_gpu_offload` (device) of the largest parameter, and the fp32 partition's "
        "`.grad` (pinned, `initialize_optimizer_states`); no fp32 master or gradient partition on the device; after "
        "each ipg bucket's reduce, this rank's share cast to fp32 on the device and copied into the host gradient "
        "partition (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`); DeepSpeedCPUAdam's exp_avg / exp_avg_sq "
        "(fp32) made on the host at the first step, the step on the CPU (cost model's CPU bandwidth, assumed), the "
        "partition copied back through the bit16 buffer, then the all-gather of the parameters. Assumed: DeepSpeed's "
        "default grad_accum_dtype (no compact fp32 partition buffer on the device); gradient accumulation refused.",
        "",
        *zero_table(), "",
        "- Left for later: ZeRO-Offload under stage 1 and 3 (`offload_param`), NVMe, gradient accumulation through "
        "the host buffers; FSDP2's offload with one rank; `time_per_step_s` (the last memory event) for runs whose "
        "last step ends without one.",
        ""])


def main() -> None:
    t0 = time.perf_counter()
    rows = []
    for preset, precisions in PRESETS.items():
        for precision in precisions:
            for optimizer in OPTIMIZERS:
                plain, _, _ = validate(build_scenario({"preset": preset}, training(preset, optimizer, precision,
                                                                                    "none", False), {"device": "cpu"}))
                for gradients in (False, True):
                    rows.append(run_case(preset, optimizer, precision, gradients, plain))
                    print(rows[-1]["label"], "ok" if rows[-1]["objects_exact"] and rows[-1]["host_exact"] else "DIFF",
                          file=sys.stderr)
    for preset in ("tiny", "tiny-mlp"):  # the hooks run once per micro-batch, each copying the gradient again
        plain, _, _ = validate(build_scenario({"preset": preset}, training(preset, "adamw", "fp32", "none", False, 2),
                                              {"device": "cpu"}))
        rows.append(run_case(preset, "adamw", "fp32", False, plain, grad_accum=2))
        print(rows[-1]["label"], "ok" if rows[-1]["objects_exact"] and rows[-1]["host_exact"] else "DIFF",
              file=sys.stderr)
    replace_section(SECTION, render(rows, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
