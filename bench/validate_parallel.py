"""Model-parallel ranks on real runs (gloo, 127.0.0.1) vs the simulator, per rank: pipelines, DTensor tensor
parallelism, FSDP2 x TP (2D) and TP x PP, context parallelism; then expert parallelism (bench/validate_expert.py,
its own section).

For each case the tiny GPT-2 (or Llama) is cut into pp x virtual_stages stages as torchtitan cuts a model
(models/parallel/stages.py `stage_layout`), run for real with `PipelineStage` and ScheduleGPipe /
Schedule1F1B / ScheduleInterleaved1F1B on `pp` CPU processes, every rank measured with the project's tracker
(traces/pipeline_run.py), and simulated with the same setup on the "cpu" profile. Prints the
"Model parallelism (real CPU runs)" section of bench/VALIDATION.md; `--write` swaps it into the file (the
rest is kept).

    python bench/validate_parallel.py [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from sections import replace_section  # bench/sections.py, beside this script
from validate_expert import SECTION as EXPERT_SECTION  # beside this script
from validate_expert import expert_section

from peakledger.analysis.validate import compare_logs, static_rows
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.traces.pipeline_run import measure_pipeline

SECTION = "## Model parallelism (real CPU runs)"
CASES = [  # (schedule, pp, virtual stages, micro-batches, preset, n_layer override)
    ("gpipe", 2, 1, 4, "tiny", None), ("gpipe", 4, 1, 8, "tiny", None),
    ("1f1b", 2, 1, 4, "tiny", None), ("1f1b", 2, 1, 8, "tiny", None), ("1f1b", 4, 1, 8, "tiny", None),
    ("1f1b", 4, 1, 4, "tiny-llama", None),
    ("interleaved-1f1b", 2, 2, 4, "tiny", None), ("interleaved-1f1b", 2, 2, 6, "tiny", None),
    ("interleaved-1f1b", 4, 2, 8, "tiny", 6), ("interleaved-1f1b", 4, 2, 8, "tiny-llama", 6),
]


def setup_for(schedule: str, pp: int, v: int, m: int) -> TrainingSetup:
    return TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", steps=2, optimizer="adamw", grad_accum=m,
                         world_size=pp, pp=pp, pp_schedule=schedule, virtual_stages=v)


def compare_case(schedule: str, pp: int, v: int, m: int, name: str, n_layer: int | None) -> dict:
    cfg = preset(name) if n_layer is None else dataclasses.replace(preset(name), n_layer=n_layer)
    setup = setup_for(schedule, pp, v, m)
    t0 = time.perf_counter()
    measured = measure_pipeline(cfg, setup)
    seconds = time.perf_counter() - t0
    graph = describe(cfg, setup, "cpu", all_steps=True)
    simulated = simulate(graph)
    timing = graph.metadata.pipeline["timing"]
    rows = []
    for rank, log in enumerate(measured):
        val = compare_logs(log, simulated, rank=rank)
        rows.append({"rank": rank, "stages": [s["index"] for s in log.metadata.stages],
                     "layers": [tuple(s["layers"]) for s in log.metadata.stages],
                     "measured": val.overall.measured, "predicted": val.overall.predicted,
                     "error": val.overall.error, "static_exact": static_rows(log, rank) == static_rows(simulated, rank),
                     "static": static_rows(log, rank), "bubble": timing[rank]["bubble"]})
    return {"rows": rows, "seconds": seconds, "model": f"{name}" + (f" ({n_layer} layers)" if n_layer else ""),
            "first_last": (rows[-1]["measured"] - rows[0]["measured"], rows[-1]["predicted"] - rows[0]["predicted"])}


MESH_CASES = [  # (preset, tp, pp, dp, schedule, micro-batches, sequence parallel): DTensor TP alone, 2D, TP x PP
    ("tiny", 2, 1, 1, None, 1, False), ("tiny", 2, 1, 1, None, 1, True), ("tiny", 4, 1, 1, None, 1, True),
    ("tiny-llama", 2, 1, 1, None, 1, False), ("tiny-llama", 2, 1, 1, None, 1, True),
    ("tiny", 2, 1, 2, None, 1, False), ("tiny-llama", 2, 1, 2, None, 1, True),
    ("tiny", 2, 2, 1, "1f1b", 4, False), ("tiny", 2, 2, 1, "gpipe", 4, True),
    ("tiny-llama", 2, 2, 1, "1f1b", 8, False), ("tiny-llama", 2, 2, 1, "gpipe", 4, True),
    ("tiny", 1, 2, 2, "1f1b", 4, False), ("tiny-llama", 1, 2, 2, "gpipe", 4, False),  # FSDP2 x PP
    ("tiny-llama", 2, 2, 2, "gpipe", 4, True),  # FSDP2 x TP x PP (3D), 8 processes
]
CP_CASES = [  # context parallelism: (preset, cp, tp, world_size, dp_engine or None for cp alone)
    ("tiny", 2, 1, 2, None), ("tiny", 4, 1, 4, None), ("tiny-llama", 2, 1, 2, None),
    ("tiny", 2, 1, 2, "fsdp2"), ("tiny", 2, 1, 4, "fsdp2"), ("tiny-llama", 2, 1, 4, "fsdp2"),
    ("tiny", 2, 2, 4, None), ("tiny-llama", 2, 2, 4, None),
]


def mesh_setup(tp: int, pp: int, dp: int, schedule: str | None, m: int, sp: bool) -> TrainingSetup:
    extra = dict(pp=pp, pp_schedule=schedule) if pp > 1 else {}
    return TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", steps=2, optimizer="adamw", grad_accum=m,
                         world_size=tp * pp * dp, tp=tp, sequence_parallel=sp,
                         dp_engine="fsdp2" if dp > 1 else "deepspeed", **extra)


def compare_mesh_case(name: str, tp: int, pp: int, dp: int, schedule: str | None, m: int, sp: bool) -> dict:
    """One tensor-parallel layout measured for real (DTensor alone: traces/tensor_run.py; with FSDP2 or a pipeline:
    traces/mesh_run.py) and simulated, every rank."""
    from peakledger.traces.mesh_run import measure_mesh
    from peakledger.traces.tensor_run import measure_tensor_parallel

    cfg, setup = preset(name), mesh_setup(tp, pp, dp, schedule, m, sp)
    t0 = time.perf_counter()
    measured = (measure_tensor_parallel(cfg, setup, tp, sp) if pp == dp == 1 else measure_mesh(cfg, setup))
    seconds = time.perf_counter() - t0
    simulated = simulate(describe(cfg, setup, "cpu", ranks=list(range(setup.mesh.world_size)), all_steps=True))
    rows = []
    for rank, log in enumerate(measured):
        val = compare_logs(log, simulated, rank=rank)
        rows.append({"rank": rank, "measured": val.overall.measured, "predicted": val.overall.predicted,
                     "error": val.overall.error, "static": static_rows(log, rank),
                     "static_exact": static_rows(log, rank) == static_rows(simulated, rank)})
    return {"rows": rows, "seconds": seconds}


def mesh_lines() -> tuple[list[str], float, bool, float]:
    lines = ["### Tensor parallelism, FSDP2 x TP (2D), TP x PP, FSDP2 x PP and FSDP2 x TP x PP (3D)", "",
             "DTensor `parallelize_module` with torchtitan's plan (ColwiseParallel / RowwiseParallel, vocab-parallel "
             "embedding, `loss_parallel`; with sequence parallelism SequenceParallel norms and sequence-sharded "
             "residual stream) on `tp` CPU processes (traces/tensor_run.py); 2D: then `fully_shard` per block and on "
             "the root over the dp sub-mesh; TP x PP: each pipeline stage module tensor-parallelized, the schedule "
             "run under `loss_parallel()`; FSDP2 x PP: each stage module `fully_shard`-ed, the schedule's backward "
             "without gradient sync or reshard, one `perform_reduce_grad` after the last micro-batch "
             "(traces/mesh_run.py). Mesh (pp, dp, tp), tp innermost: rank = (pp x dp + dp_i) x tp + tp_i. fp32 "
             "AdamW, micro-batch 2, seq 32, 2 steps.", "",
             "| model | tp | pp (schedule, micro-batches) | dp (FSDP2) | SP | rank | "
             "measured peak B | predicted peak B "
             "| error | static rows exact | static rows B (param / grad / state) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    worst, all_static, runs, first_last = 0.0, True, 0.0, []
    for name, tp, pp, dp, schedule, m, sp in MESH_CASES:
        case = compare_mesh_case(name, tp, pp, dp, schedule, m, sp)
        runs += case["seconds"]
        for r in case["rows"]:
            worst = max(worst, abs(r["error"]))
            all_static &= r["static_exact"]
            s = r["static"]
            lines.append(f"| {name} | {tp} | {f'{pp} ({schedule}, {m})' if pp > 1 else '1'} | {dp} | "
                         f"{'on' if sp else 'off'} | {r['rank']} | {r['measured']:,} | {r['predicted']:,} | "
                         f"{r['error']:+.3%} | {'yes' if r['static_exact'] else 'NO'} | {s['parameter']:,} / "
                         f"{s['gradient']:,} / {s['optimizer_state']:,} |")
        if pp > 1:
            rows = case["rows"]
            first_last.append((name, tp, pp, dp, schedule, m, sp, rows[-1]["measured"] - rows[0]["measured"],
                               rows[-1]["predicted"] - rows[0]["predicted"]))
    lines += ["", "Pipelines on the mesh, last stage - first stage peak:", "",
              "| model | tp | pp (schedule, micro-batches) | dp (FSDP2) | SP | measured B | predicted B |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {tp} | {pp} ({sc}, {m}) | {dp} | {'on' if sp else 'off'} | {a:+,} | {b:+,} |"
              for n, tp, pp, dp, sc, m, sp, a, b in first_last]
    lines += [""]
    return lines, worst, all_static, runs


def context_lines() -> tuple[list[str], float, bool, float]:
    """Context parallelism: torch's `context_parallel` measured for real (traces/context_run.py) vs simulated, alone
    and with FSDP2 over dp x cp (torchtitan's dp_shard_cp)."""
    from peakledger.traces.context_run import measure_context_parallel
    from peakledger.traces.distributed import without_backend_copies

    lines = ["### Context parallelism (ring attention)", "",
             "torch's `context_parallel` around each micro-batch's forward and backward (head-tail load balancing, "
             "k / v all-gathered once per attention call, partial results merged in fp32, k / v gradients rotated by "
             "all-to-all; the inputs, labels and an int64 position buffer sharded on the sequence), on CPU "
             "processes (traces/context_run.py). torch 2.13's ring attention knows the CUDA SDPA kernels only: on "
             "CPU the harness adds the Shard(2) sharding rule of the CPU flash SDPA op and routes it to torch's own "
             "`_templated_ring_attention` (nothing else); the models run `attention=\"sdpa\"`. cp alone: gradients "
             "averaged over the cp ranks in place. FSDP2: `fully_shard` on every block and the root over dp x cp "
             "(torchtitan's dp_shard_cp mesh, flattened from (dp, cp)), which reduce-scatters the gradients; gloo's "
             "reduce-scatter copies are dropped from the measurement (`without_backend_copies`). cp x tp: the (cp, "
             "tp) mesh, traces/tensor_run.py's DTensor plan on \"tp\" (no sequence parallelism), then "
             "`context_parallel` on \"cp\" over the local heads, the loss under `loss_parallel()`. fp32 AdamW, "
             "micro-batch 2, seq 32, 2 steps. The simulation walks torch's ring loops (models/parallel/ring.py) and "
             "gives each call's highest point as one workspace block; FSDP2 shards over dp x cp "
             "(models/parallel/mesh.py `folds_cp`).", "",
             "| model | dp x cp x tp | data parallel | rank | measured peak B | predicted peak B | "
             "error | forward peak "
             "measured / predicted B | backward peak measured / predicted B | static rows exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    worst, all_static, runs = 0.0, True, 0.0
    for name, cp, tp, world, engine in CP_CASES:
        cfg = dataclasses.replace(preset(name), attention="sdpa")
        setup = TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", steps=2, optimizer="adamw", cp=cp, tp=tp,
                              world_size=world, **({"dp_engine": engine} if engine else {}))
        t0 = time.perf_counter()
        measured = [without_backend_copies(log) for log in measure_context_parallel(cfg, setup)]
        runs += time.perf_counter() - t0
        simulated = simulate(describe(cfg, setup, "cpu", ranks=list(range(world)), all_steps=True))
        for rank, log in enumerate(measured):
            v = compare_logs(log, simulated, rank=rank)
            phase = {p.label: p for p in v.phases}
            fwd, bwd = phase["forward step 1"], phase["backward step 1"]
            exact = static_rows(log, rank) == static_rows(simulated, rank)
            worst, all_static = max(worst, abs(v.overall.error)), all_static and exact
            lines.append(f"| {name} | {world // (cp * tp)} x {cp} x {tp} | {engine or '-'} | {rank} | "
                         f"{v.overall.measured:,} | "
                         f"{v.overall.predicted:,} | {v.overall.error:+.3%} | {fwd.measured:,} / {fwd.predicted:,} | "
                         f"{bwd.measured:,} / {bwd.predicted:,} | {'yes' if exact else 'NO'} |")
    return lines + [""], worst, all_static, runs


def _stages_text(row: dict) -> str:
    return ", ".join(f"{s} ({'-' if a == b else f'{a}-{b - 1}'})" for s, (a, b) in zip(row["stages"], row["layers"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="swap the section into bench/VALIDATION.md")
    args = parser.parse_args()
    lines = [SECTION, "",
             "Regenerate with `python bench/validate_parallel.py --write` (real torch.distributed.pipelining runs, "
             "gloo on 127.0.0.1, torch 2.13; fp32 AdamW foreach, micro-batch 2, seq 32, 2 steps; `PipelineStage` "
             "with static shapes, `schedule.step(x, target=y, return_outputs=False)` as torchtitan calls it). The "
             "stages are torchtitan's split (`generate_llm_fqn_per_model_part`: embeddings and output count one "
             "layer each); a stage's blocks are given in brackets (- : none, the embeddings or the head alone). "
             "Static rows: parameter + gradient + optimizer-state bytes of the rank when step 1's optimizer phase "
             "ends. Bubble: the simulated idle fraction of the rank's compute stream in its last step (cost model "
             "of the cpu profile: it orders events, it is not a measured time).", "",
             "| schedule | pp x v | micro-batches | model | rank | stages (blocks) | measured peak B "
             "| predicted peak B | error | static rows exact | "
             "static rows B (param / grad / state) | simulated bubble |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    worst, all_static, first_last, runs = 0.0, True, [], 0.0
    for schedule, pp, v, m, name, n_layer in CASES:
        case = compare_case(schedule, pp, v, m, name, n_layer)
        runs += case["seconds"]
        first_last.append((schedule, pp, v, m, case["model"], *case["first_last"]))
        for r in case["rows"]:
            worst = max(worst, abs(r["error"]))
            all_static &= r["static_exact"]
            s = r["static"]
            lines.append(f"| {schedule} | {pp} x {v} | {m} | {case['model']} | {r['rank']} | {_stages_text(r)} | "
                         f"{r['measured']:,} | {r['predicted']:,} | {r['error']:+.3%} | "
                         f"{'yes' if r['static_exact'] else 'NO'} | {s['parameter']:,} / {s['gradient']:,} / "
                         f"{s['optimizer_state']:,} | {r['bubble']:.0%} |")
    lines += ["", "Last stage - first stage peak (what the layout and the schedule put apart):", "",
              "| schedule | pp x v | micro-batches | model | measured B | predicted B |", "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {pp} x {v} | {m} | {model} | {a:+,} | {b:+,} |" for s, pp, v, m, model, a, b in first_last]
    lines += ["", f"Worst per-rank peak error {worst:.4%} (target 1%); static rows exact on "
              f"{'every' if all_static else 'NOT every'} rank; the real runs took {runs:.0f} s. The few bytes "
              "apart are the 4-byte `ones_like` of each loss's backward and the first step's 4-byte P2P warm-up "
              "vote tensors, not modelled.", "",
              "What decides the stage peaks (models/parallel/pipeline.py `PipelineRank`): every non-first stage "
              "allocates m activation receive buffers and every non-last stage m gradient receive buffers in the "
              "first step, kept for good; a micro-batch's activations stay until its backward; and the schedule's "
              "own Python references keep sent tensors past that: ScheduleGPipe and the multi-stage runtime keep "
              "every send's Work (its output or input gradient) until the step returns, Schedule1F1B only its "
              "latest P2POps and unfused send. A gradient summed into a receive buffer is summed out of place "
              "(autograd does not own it). A tied embedding / head weight is one copy per end stage.", ""]
    mesh, mesh_worst, mesh_static, mesh_runs = mesh_lines()
    lines += mesh + [f"Worst per-rank peak error {mesh_worst:.4%} (target 1%); static rows exact on "
                     f"{'every' if mesh_static else 'NOT every'} rank; the real runs took {mesh_runs:.0f} s.", ""]
    cp_lines, cp_worst, cp_static, cp_runs = context_lines()
    lines += cp_lines + [f"Worst per-rank peak error {cp_worst:.4%} (target 1%); static rows exact on "
                         f"{'every' if cp_static else 'NOT every'} rank; the real runs took {cp_runs:.0f} s.", ""]
    section = "\n".join(lines)
    if args.write:
        replace_section(SECTION, section)
    sys.stdout.write(section)
    experts = expert_section()  # bench/validate_expert.py: expert parallelism, its own section
    if args.write:
        replace_section(EXPERT_SECTION, experts)
    sys.stdout.write("\n" + experts)


if __name__ == "__main__":
    main()
