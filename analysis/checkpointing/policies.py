"""The policy table: one scenario simulated under each checkpointing policy, its peak beside its recompute and
step time (`policy_table`, `render_table`, `plot_peak_vs_recompute`; analysis/checkpointing/__init__.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...models.config import ConfigError
from ...models.devices import device_profile
from ...models.families import family_of
from ..units import Scale
from .runs import DEFAULT_POLICIES, host_activations, simulate_run, step_flops, step_time


@dataclass(frozen=True)
class PolicyRow:
    """One policy on one scenario. Sizes in bytes, FLOPs and seconds per optimizer step (all micro-batches).

    `error` is set (and the numbers are 0) when the policy does not apply to the model (e.g. "selective"
    on an MLP), with the reason."""

    policy: str
    label: str
    peak: int = 0
    capacity_needed: int = 0
    host_activations: int = 0
    model_flops: int = 0
    recompute_flops: int = 0
    step_time_s: float = 0.0
    error: str | None = None
    compiled: bool = False  # torch.compile's program (models/compile), the policy inside its graphs

    @property
    def recompute_fraction(self) -> float:
        """Recomputed FLOPs as a share of the forward + backward FLOPs."""
        return self.recompute_flops / self.model_flops if self.model_flops else 0.0

    def as_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["recompute_fraction"] = self.recompute_fraction
        return out


def policy_label(setup) -> str:
    """The policy with the knob that shapes it: "every-k (k=2)", "layers [0, 3]"."""
    if setup.checkpointing.policy == "every-k":
        return f"every-k (k={setup.checkpointing.every_k})"
    if setup.checkpointing.policy == "layers":
        return f"layers {list(setup.checkpointing.layers)}"
    return setup.checkpointing.policy


COMPILE_POLICIES = ("none", "full", "op-policy")  # the rows torch.compile adds where it is modelled


def streams_applies(scenario) -> bool:
    """Whether the table gets a row for activation_offload "streams" (models/replay/offload_streams.py): the
    hand-written transformer tapes, uncompiled, on one device, not offloading already."""
    from ...models.families import family_of, nanogpt
    s = scenario.setup
    return (family_of(scenario.model) is nanogpt.FAMILY and s.checkpointing.activation_offload == "none"
            and not s.compile.on and s.mesh.world_size == 1 and not s.lora.r and s.batch.passes == "train")


def compile_applies(scenario) -> bool:
    """Whether torch.compile is one more fix to try: a traced model, or a hand-written model whose family gives an HF
    equivalent (`Family.hf_equivalent`, which a compiled preset runs as) and it has one, not compiled already, on the
    cpu profile or on a CUDA profile this torch lowers inductor's CUDA program for (models/compile/gpu.py
    `lowerable`: a CUDA build of torch seeing a device of the profile's compute capability); elsewhere compile is
    refused."""
    family = family_of(scenario.model)
    if scenario.setup.compile.on or (family.hand_written and family.hf_equivalent is None):
        return False
    if family.hf_equivalent is not None:
        try:
            family.hf_equivalent(scenario.model)
        except ConfigError:
            return False
    profile = device_profile(scenario.device)
    if profile.is_cpu:
        return True
    from ...models.compile.gpu import lowerable

    return profile.is_cuda and lowerable(profile.compute_capability)


def policy_table(scenario, policies=DEFAULT_POLICIES, with_compile: bool = True,
                 with_streams: bool = False) -> list[PolicyRow]:
    """Simulate `scenario` under each policy in `policies` (names of `TrainingSetup.checkpointing`; "every-k"
    takes the scenario's `checkpoint_every_k`, "layers" its `checkpoint_layers`); and, `with_compile` where
    `compile_applies`, compiled under each of `COMPILE_POLICIES`. A compiled graph marks no op as recomputed (the
    partitioner puts the recompute in the backward graph), so a compiled row's recompute is the FLOPs its step runs
    over the compiled row without checkpointing. `with_streams`: a last row for activation_offload "streams"
    where `streams_applies` (the `peakledger checkpointing` command's table)."""
    cases = [(policy, False) for policy in policies]
    if with_compile and compile_applies(scenario):
        cases += [(policy, True) for policy in COMPILE_POLICIES]
    compiled = scenario.setup.compile.on
    rows = []
    for policy, add_compile in cases:
        changes = {"checkpointing": policy, **({"compile": True} if add_compile else {})}
        if policy != "layers":
            changes["checkpoint_layers"] = ()
        added = ("compile" if policy == "none" else f"compile + {policy}") if add_compile else None
        try:
            case = scenario.with_changes(**changes)
            run = simulate_run(case)
        except ConfigError as e:
            rows.append(PolicyRow(policy, added or policy, error=str(e), compiled=compiled or add_compile))
            continue
        model_flops, recompute_flops = step_flops(run.graph, run.rank)
        rows.append(PolicyRow(policy=policy, label=added or policy_label(case.setup), peak=run.peak,
                              capacity_needed=run.capacity_needed,
                              host_activations=host_activations(run.log, run.rank),
                              model_flops=model_flops, recompute_flops=recompute_flops,
                              step_time_s=step_time(run.graph), compiled=compiled or add_compile))
    if with_streams and streams_applies(scenario):  # activation offload with streams (torchtune), beside the policies
        try:
            case = scenario.with_changes(checkpointing="none", checkpoint_layers=(), activation_offload="streams")
            run = simulate_run(case)
            model_flops, recompute_flops = step_flops(run.graph, run.rank)
            rows.append(PolicyRow(policy="streams", label="streams (torchtune)", peak=run.peak,
                                  capacity_needed=run.capacity_needed,
                                  host_activations=host_activations(run.log, run.rank), model_flops=model_flops,
                                  recompute_flops=recompute_flops, step_time_s=step_time(run.graph)))
        except ConfigError as e:
            rows.append(PolicyRow("streams", "streams (torchtune)", error=str(e)))
    base = next((r for r in rows if r.compiled and r.policy == "none" and r.error is None), None)
    if base is not None:
        rows = [dataclasses.replace(r, model_flops=base.model_flops,
                                    recompute_flops=max(0, r.model_flops - base.model_flops))
                if r.compiled and r.error is None else r for r in rows]
    return rows


def render_table(rows: list[PolicyRow], unit: str | None = None) -> str:
    """The table as text: peak, host memory (offload), recompute FLOPs and share, step time, per policy; each
    column in one unit (the sizes in `unit`, else their largest's: analysis/units.py Scale), named in the head."""
    base = next((r for r in rows if r.policy == "none" and r.error is None and not r.compiled), None)
    ok = [r for r in rows if not r.error]
    size = Scale.of([r.peak for r in ok] + [r.host_activations for r in ok], unit)
    flops = Scale.of([r.recompute_flops for r in ok], kind="flops")
    time = Scale.of([r.step_time_s for r in ok], kind="seconds")
    head = (f"{'policy':<22}{'peak ' + size.unit:>13}{'vs none':>9}{'host ' + size.unit:>13}"
            f"{'recompute ' + flops.unit:>18}{'of fwd+bwd':>12}{'step ' + time.unit:>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.label:<22}  n/a: {r.error}")
            continue
        saved = f"{(r.peak - base.peak) / base.peak:+.1%}" if base and base.peak else ""
        host = size.number(r.host_activations) if r.host_activations else "-"
        lines.append(f"{r.label:<22}{size.number(r.peak):>13}{saved:>9}{host:>13}"
                     f"{flops.number(r.recompute_flops):>18}{r.recompute_fraction:>12.1%}"
                     f"{time.number(r.step_time_s):>12}")
    lines.append("")
    lines.append("peak: device memory of the worst rank; host: activations offloaded to host memory at most; "
                 "recompute: forward FLOPs repeated in backward per step (ops the cost model gives FLOPs: matmuls, "
                 "attention, norms, softmax); step: the simulated time per step (vendor peaks x assumed "
                 "efficiencies, host-link copies included)")
    if any(r.compiled for r in rows):
        lines.append("compile: torch.compile (inductor) of the same step, the policy inside its graphs; its first "
                     "step compiles (tens of seconds to minutes, not in the step time); its recompute is the FLOPs "
                     "its backward graphs run over compile without checkpointing")
    return "\n".join(lines)


def plot_peak_vs_recompute(rows: list[PolicyRow], path: str, title: str = "", unit: str = "GiB", **options) -> None:
    """Each policy's device memory against its step time, the budget and the chosen layer set (`options`:
    budget, chosen, setup), written atomically; drawn by analysis/plot.py `checkpointing_figure`."""
    from ..plot import plot_peak_vs_recompute as draw  # matplotlib, loaded for the picture only

    draw(rows, path, title, unit, **options)
