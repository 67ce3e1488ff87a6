"""The report of one run as text (`render_text`): the setup it ran, the peaks, the ledger at the peak, the phases,
the host, the assumptions; the pieces `peakledger simulate` prints and the HTML report (export_html.py) reuses.
analysis/report.py builds the Report and its JSON."""

from __future__ import annotations

from collections.abc import Sequence

from ..models.config import TrainingSetup
from ..models.training import StepPlan
from ..simulator.run_metadata import RunMetadata
from .device import context_of, device_lines, torch_rules
from .explain import cause
from .host import host_ledger_lines, host_uses
from .ledger import LedgerRow
from .phases import phase_lines
from .report import Report, assumptions, run_events, run_plan, training_flops
from .units import Scale, format_bytes, format_flops


def _stages(metadata: RunMetadata, rank: int) -> str:
    """", stage 3" / ", stages 3, 19": the pipeline stages of global `rank` (its pp coordinate on the mesh)."""
    pipeline = metadata.pipeline
    if not pipeline:
        return ""
    s = metadata.setup
    pp = rank // (s.mesh.world_size // s.mesh.pp)  # pp is the mesh's outermost dimension (models/parallel/mesh.py)
    stages = [str(st["index"]) for st in pipeline["stages"] if st["rank"] == pp]
    return f", stage{'s' if len(stages) > 1 else ''} {', '.join(stages)}"


def _engine_short(setup: TrainingSetup) -> str:
    engine = setup.data_parallel.engine
    name = f"ZeRO-{setup.data_parallel.deepspeed.zero_stage}" if engine == "deepspeed" else engine
    pp = f", pp {setup.mesh.pp} ({setup.mesh.pp_schedule})" if setup.mesh.pp > 1 else ""
    tp = f", tp {setup.mesh.tp}" + (" + SP" if setup.mesh.sequence_parallel else "") if setup.mesh.tp > 1 else ""
    return f"{name} x {setup.mesh.dp}{pp}{tp}"


def _expert_text(ep: dict) -> str:
    """ep, experts per rank, routing, and the rows the ranks receive per MoE layer (max over layers) vs send."""
    got = {r: max(rows) for r, rows in ep["received_rows"].items()}
    low, high = min(got.values()), max(got.values())
    received = f"{high:,}" if low == high else f"{low:,} .. {high:,} (rank {max(got, key=got.get)} the most)"
    return (f"ep {ep['ep']}, {ep['experts_per_rank']} experts a rank (torchtitan's all-to-all dispatch), routing "
            f"{ep['routing']}: each rank sends {ep['sent_rows']:,} rows a layer and receives {received}")


def _engine_text(setup: TrainingSetup) -> str:
    engine, dp = setup.data_parallel.engine, setup.mesh.dp
    if engine == "deepspeed":
        return f"DeepSpeed ZeRO-{setup.data_parallel.deepspeed.zero_stage} on {dp} ranks"
    if engine == "fsdp2":
        return (
            f"FSDP2 fully_shard on {dp} ranks, reshard_after_forward="
            f"{setup.data_parallel.fsdp2.reshard_after_forward}, prefetch forward "
            f"{setup.data_parallel.fsdp2.forward_prefetch} / backward {setup.data_parallel.fsdp2.backward_prefetch}"
        )
    return f"{engine} on {dp} ranks"


def _pipeline_text(setup: TrainingSetup) -> str:
    v = setup.mesh.virtual_stages
    return (f"{setup.mesh.pp} stages ({setup.mesh.pp} x {v} virtual)" if v > 1 else f"{setup.mesh.pp} stages") + \
        f", schedule {setup.mesh.pp_schedule}, {setup.batch.grad_accum} micro-batches per step"


def _rank_range(ranks: Sequence[int]) -> str:
    if len(ranks) > 1 and len(ranks) == ranks[-1] - ranks[0] + 1:  # ascending distinct ranks: one range
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "rank " + ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{len(ranks)} ranks from {ranks[0]}"


def _offload_text(setup: TrainingSetup) -> str:
    mode = setup.offload.mode
    if mode == "none":
        return ""
    if mode == "states":
        return "; optimizer states offloaded to the host between steps"
    return (f"; optimizer states offloaded, updated in chunks of {setup.offload.chunk_params:,} parameters "
            f"({setup.offload.prefetch} ahead; first step {setup.offload.first_step})")


def steps_text(plan: StepPlan) -> str:
    """"20000 steps (steps 1-4 simulated; steps 5-20000 repeat step 4's events)", or "2 steps"."""
    return f"{plan.steps} steps" + (f" ({plan.summary()})" if plan.truncated else "")


LOOP_WORDS = {"plain": "plain (the default; --loop hf-trainer for HF Trainer's step): out = model(batch); "
                       "loss = loss_fn(out); loss.backward(), `out` (the logits) held until backward ends",
              "hf-trainer": "hf-trainer (HF Trainer's training_step): loss = compute_loss(model, batch), the "
                            "outputs dropped before backward; clip_grad_norm_(1.0) before each optimizer step"}


def setup_lines(r: Report) -> list[str]:
    """The report's first lines: the run (model, device, rank and pool), then its setup, one line a part."""
    md, pk = r.metadata, r.peaks
    lines = [f"peakledger: {r.name}  ({md.model} on {md.device}, rank {pk.rank} {pk.pool.value} memory)"]
    setup = md.setup
    if setup is not None:
        b_eff = md.effective_batch
        lines.append(f"  {md.n_params:,} parameters ({md.n_trainable:,} trainable); precision "
                     f"{setup.precision.name}, optimizer {setup.optimizer.name} ({setup.optimizer.impl}), "
                     f"{_engine_short(setup)}, checkpointing {setup.checkpointing.policy}"
                     + _offload_text(setup))
        if md.batch:  # a traced model: its own batch
            lines.append(f"  described by: {md.describer}; batch per micro-batch: {md.batch}")
        else:
            lines.append(f"  described by: {md.describer}")
        if setup.batch.passes == "train":
            lines.append("  loop: " + LOOP_WORDS.get(setup.loop.name, setup.loop.name))
        if r.gpu is not None:
            lines.append(f"  GPU rules: torch {torch_rules(r.log)}'s CUDA kernels and caching allocator "
                         f"on {md.device}" + (f" ({md.torch_rules})" if md.torch_rules else ""))
        if md.batch:
            if md.describer_note:
                lines.append(f"  note: {md.describer_note}")
            lines.append(
                f"  B_eff = micro-batch {setup.batch.micro_batch} x accumulation {setup.batch.grad_accum} x dp "
                f"{setup.mesh.dp} = {b_eff}; {steps_text(run_plan(r.log))}"
            )
        else:
            lines.append(
                f"  B_eff = micro-batch {setup.batch.micro_batch} x accumulation {setup.batch.grad_accum} x dp "
                f"{setup.mesh.dp} = {b_eff}; seq_len {setup.batch.seq_len}; {steps_text(run_plan(r.log))}"
            )
        if setup.mesh.dp > 1:
            lines.append(f"  data parallel: {_engine_text(setup)}")
        if setup.mesh.pp > 1:
            lines.append(f"  pipeline parallel: {_pipeline_text(setup)}")
        if setup.mesh.tp > 1:
            lines.append(f"  tensor parallel: tp {setup.mesh.tp} (DTensor, torchtitan's plan, loss_parallel), sequence "
                         f"parallel {'on' if setup.mesh.sequence_parallel else 'off'}")
        if setup.mesh.cp > 1:
            lines.append(f"  context parallel: cp {setup.mesh.cp} (torch's context_parallel: ring attention, head-tail "
                         f"load balancing, T / cp = {setup.batch.seq_len // setup.mesh.cp} tokens a rank)")
        if md.expert_parallel:
            lines.append(f"  expert parallel: {_expert_text(md.expert_parallel)}")
        if md.counted_flops_per_step:  # a traced model: torch's FLOP formulas over the recorded ops
            lines.append(f"  training FLOPs per step ~ {format_flops(md.counted_flops_per_step)} per rank (counted "
                         "over the traced forward and backward ops: matmuls, attention, convolutions)")
        elif md.n_active_params is not None:
            flops = training_flops(md.n_active_params, md.tokens_per_step)
            lines.append(f"  training FLOPs per step ~ {format_flops(flops)} "
                         f"(6ND over {md.n_active_params:,} active parameters: "
                         f"{md.experts} per token)")
        else:
            flops = training_flops(md.n_trainable or 0, md.tokens_per_step)
            lines.append(f"  training FLOPs per step ~ {format_flops(flops)} (6ND, dense-model approximation)")
    return lines


def peak_lines(r: Report, unit: str | None = None) -> list[str]:
    """The true peak, the first-step and steady peaks (with why the first step is higher), the host peak and
    the capacity needed, one line each, in one unit (`unit`, else the largest value's)."""
    pk, setup = r.peaks, r.metadata.setup
    lines: list[str] = []
    e = pk.overall.event
    if e is not None:
        peak_values = [pk.overall.bytes, pk.first_step.bytes, pk.steady.bytes if pk.steady else None,
                       r.host.overall.bytes if r.host is not None else None, r.capacity_needed if pk.headroom else None]
        f = Scale.of(peak_values, unit).text  # one unit for the block
        lines.append(f"true peak        {f(pk.overall.bytes):>14}  at {e.op} ({e.phase.value}, step {e.step}"
                     + (f", micro-batch {e.micro_batch_index}" if e.micro_batch_index >= 0 else "") + ")")
        lines.append(f"first-step peak  {f(pk.first_step.bytes):>14}  at {pk.first_step.event.op}")
        if pk.steady is not None and pk.steady.event is not None:
            lines.append(f"steady peak      {f(pk.steady.bytes):>14}  at {pk.steady.event.op} (steps >= 2)")
            if pk.first_step.bytes > pk.steady.bytes:
                lines.append(f"  the first step is {f(pk.first_step.bytes - pk.steady.bytes)} above the steady state: "
                             + cause(pk.first_step.event, pk.first_step.live_by_category, setup))
        if r.host is not None:
            he = r.host.overall.event
            use = host_uses(r.log, r.index).get(r.host.rank)
            lines.append(
                f"host peak        {f(r.host.overall.bytes):>14}  at {he.op} ({he.phase.value}, step {he.step})"
                f"  (rank {r.host.rank} host memory)"
            )
            if use is not None:  # the same peak, split by Block.pinned
                lines.append(f"  pinned {f(use.pinned_at_peak)}, pageable {f(use.pageable_at_peak)} at the host peak; "
                             f"pinned peak {f(use.pinned_peak)}")
        if pk.headroom:
            what = "device total" if r.gpu is not None else "peak"
            lines.append(f"capacity needed  {f(r.capacity_needed):>14}  ({what} x (1 + {pk.headroom:g}) headroom)")
    return lines


LEDGER_HEAD = ["row", "at peak", "dtype", "shard", "tensors", "share", "row max"]


def ledger_table(rows: list[LedgerRow], unit: str | None = None) -> tuple[str, list[str], list[list[str]]]:
    """The ledger at the peak as a table: its title, LEDGER_HEAD and one row of cells per ledger row, then the
    total's, its sizes in one unit (`unit`, else the largest value's: analysis/units.py Scale); read by the text
    report and the HTML report alike."""
    total = sum(x.bytes for x in rows)
    g = Scale.of([total] + [x.max_bytes for x in rows], unit)
    body = [[row.row, g.number(row.bytes), row.dtype, str(row.shard_factor), str(row.tensors), f"{row.share:.1%}",
             g.number(row.max_bytes)] for row in rows]
    body.append(["total", g.number(total), "", "", "", "", ""])
    return f"ledger at the peak ({g.unit}; exact bytes in --json)", LEDGER_HEAD, body


def render_text(r: Report, unit: str | None = None) -> str:
    """A plain-text report (monospace tables), each table's sizes in one unit (`unit`, else its largest value's:
    analysis/units.py Scale), the unit said once."""
    md = r.metadata
    lines = setup_lines(r) + [""] + peak_lines(r, unit)
    if len(r.ranks) > 1 or any(len(rp.same_as) > 1 for rp in r.ranks):
        ranks = Scale.of([rp.peak.bytes for rp in r.ranks], unit)
        lines.append(f"per rank ({ranks.unit}), the worst first (ranks with identical layouts are simulated once):")
        for rp in sorted(r.ranks, key=lambda rp: (-rp.peak.bytes, rp.rank)):
            e = rp.peak.event
            lines.append(f"  {_rank_range(rp.same_as):<16}{ranks.number(rp.peak.bytes):>14}  at "
                         f"{e.op if e else '-'} ({e.phase.value if e else '-'}, step {e.step if e else '-'})"
                         f"{_stages(r.metadata, rp.rank)}")
    if r.gpu is not None:
        lines += [""] + device_lines(r.gpu, unit, context_of(r.log))
    if r.phases:
        lines += [""] + phase_lines(r.phases, unit, md.device_capacity)
        if run_plan(r.log).truncated:
            lines.append(f"  ({run_plan(r.log).summary()})")
    lines.append("")
    title, head, body = ledger_table(r.ledger, unit)
    lines.append(title)
    for name, at, dtype, shard, tensors, share, top in [head] + body:
        lines.append(f"  {name:<30}{at:>14}  {dtype:<16}{shard:>6}{tensors:>9}{share:>8}{top:>14}".rstrip())
    if r.host is not None:
        lines += host_ledger_lines(r.log, r.host.rank, r.host.overall.index, unit, r.index)
    f = lambda n: format_bytes(n, unit)  # noqa: E731
    for o in r.log.ooms:
        lines.append("")
        lines.append(f"OUT OF MEMORY at {o.event.op} ({o.event.phase.value}, step {o.event.step}): "
                     f"{o.event.block.name} "
                     f"needs {f(o.event.block.nbytes)} with {f(o.live_bytes)} live of {f(o.capacity)}")
        if o.message:
            lines.append(f"  torch would say: {o.message}")
    listed = assumptions(r)
    if listed:
        lines.append("")
        lines.append("assumptions (timing, and on a GPU what lies outside the allocator; the tensors' bytes do not "
                     "depend on them):")
        lines += [f"  - {a}" for a in listed]
    plan = run_plan(r.log)
    lines.append(f"{len(r.log.events):,} events" if not plan.truncated else
                 f"{len(r.log.events):,} events simulated ({run_events(r.log, r.index):,} in all {plan.steps} steps)")
    return "\n".join(lines)
