"""Capture a real CUDA memory snapshot of the reference model's training steps (GPU truth).

`capture_cuda(scenario, snapshot_path)` builds the plain-torch program of the scenario (`build_program`) on
`cuda:0`, records the caching allocator's history (`torch.cuda.memory._record_memory_history`, Python and C++
stacks, so autograd's device thread is recognisable), runs the loop of `traces.tracker.run_training_steps`
(`run_loop`: steps x (micro-batches of forward + backward), optimizer step, zero_grad), dumps the snapshot
pickle and reads it back through the restricted loader (`traces.cuda_snapshot`), so the result is the same
`EventLog` schema as every other trace.

The program is the simulator's (models/training.py, models/parallel/engine.py), precision by precision
(`CAPTURE_PRECISIONS`): fp32, pure bf16 and bf16-autocast are traces/reference/build.py's `build_model`; bf16-mixed,
which the reference models do not build, is the bf16 model (bf16 parameters and gradients, bf16 compute) with
fp32 master weights held by `MasterWeights`: the torch optimizer steps the masters (fp32 states), each step
copies the bf16 gradients to fp32 before the update (`fp32_grads`: persistent fp32 main gradients instead,
each bf16 gradient added in as autograd makes it and dropped) and the masters back into the parameters after
it. On the CPU this program matches the simulation of bf16-mixed byte for byte (tests/test_capture_cuda.py).

Steps and phases: a snapshot has neither. The loop marks the host clock at the start of every phase
(`LoopMarks`: forward and backward of each micro-batch, optimizer step, zero_grad, the end), with a quiet gap
around each mark, and `label_steps` gives every recorded event the phase, step and micro-batch of the mark
before it (the snapshot's `time_us` is the host's wall clock): steps count from 1, as the simulator's do,
and the state at record start (the model, its masters and optimizer) is the load, step 0. Events that fall
outside the marked loop (a clock that does not agree) are reported in the trace's metadata (`step_labels`).
Each phase still runs in its own function whose name carries the phase (`_peakledger_backward`, ...), for
the loader's stack heuristic when the raw pickle is read on its own.

The trace's metadata records the scenario as CPU captures do (model, model_kind, setup, scenario), so
`peakledger validate --trace` re-simulates it, and what it ran on: the GPU (`gpu`, `compute_capability`,
`gpu_total_memory`), the peakledger device profile that matches it (`device_profile`, `gpu_profile`), the
torch version and the allocator rules it follows (`allocator_rules`: the rule set of simulator/torch_rules it follows),
`PYTORCH_CUDA_ALLOC_CONF` (`alloc_conf`), and the reserved peak of the snapshot (`reserved_peak`).

A capture's memory: the model is built on the host (in fp32: `build_model` casts after building) and moved
to the GPU; the run itself holds the device. `host_need` is what the host holds (the build, or the run's
host pool when that is larger, plus the torch process and the CUDA libraries); the device side is the
simulation on the GPU's profile against the GPU's free memory (peakledger/cli.py checks both before a run).
On a machine without CUDA `cuda_device` raises `ConfigError` naming `device_kind` instead of failing inside
torch; an unsupported setup is refused before that (`check_capturable`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..models.config import ConfigError
from ..models.devices import DEVICES
from ..models.fields import as_keys
from ..models.optimizers import OPTIMIZERS
from ..simulator.events import EventLog, Phase
from ..simulator.run_metadata import RunMetadata
from ..simulator.safe_io import InputError
from ..simulator.torch_rules import RULES, nearest
from .cuda_snapshot import PREEXISTING_OP, SnapshotTrace, load_snapshot

MAX_ENTRIES = 1_000_000
CAPTURE_PRECISIONS = ("fp32", "bf16", "bf16-autocast", "bf16-mixed")
CAPTURE_OPTIMIZERS = tuple(name for name, spec in OPTIMIZERS.items() if spec.capture)  # models/optimizers.py
MARK_GAP_S = 0.002  # quiet seconds on each side of a loop mark: no allocation lies near a phase boundary


# -- what a capture runs ------------------------------------------------------------------------------

def check_capturable(scenario) -> None:
    """Refuse, naming the field, a setup the capture does not run as the simulator describes it."""
    setup = scenario.setup
    if setup.batch.passes != "train":
        raise ConfigError("passes", "capture runs real training steps (forward, loss, backward, optimizer step); "
                                    "passes \"forward\" is simulated only: drop --passes")
    if setup.precision.name not in CAPTURE_PRECISIONS:
        raise ConfigError(
            "precision",
            f"a CUDA capture runs {', '.join(CAPTURE_PRECISIONS)}; got "
            f"{setup.precision.name!r} (fp16 needs a loss scaler the simulation does not model)",
        )
    if (
        setup.mesh.world_size != 1
        or setup.data_parallel.deepspeed.zero_stage != 0
        or setup.data_parallel.engine != "deepspeed"
    ):
        raise ConfigError("world_size", "a CUDA capture is one process on one GPU, without data or model "
                                        "parallelism: world_size 1, zero_stage 0")
    if setup.optimizer.name not in CAPTURE_OPTIMIZERS:
        raise ConfigError("optimizer", f"a CUDA capture runs the optimizers {', '.join(CAPTURE_OPTIMIZERS)}; got "
                                       f"{setup.optimizer.name!r}")
    if setup.checkpoint_io.every:
        raise ConfigError("checkpoint_every", "a capture runs training steps without checkpoint saves: drop "
                                              "--checkpoint-every (saves are simulated)")
    if setup.checkpoint_io.load_mode != "none":
        raise ConfigError("load_mode", "a capture starts from a freshly built model: drop --load-mode")


class MasterWeights:
    """bf16-mixed as the simulator describes it: fp32 master copies of the trainable (bf16) parameters, made
    after them (`load.master_weights`); the torch optimizer over the masters, so its states are fp32; at each
    step the bf16 gradients copied to fp32 (`optimizer.grads_to_fp32`), the update, the masters copied back
    into the parameters and the fp32 gradients dropped (`optimizer.copy_master_to_params`); zero_grad drops
    the bf16 gradients. With `setup.precision.fp32_grads` the fp32 gradients are persistent main gradients instead
    (`load.main_grads`): a hook adds each bf16 gradient in as autograd accumulates it and drops it, and
    zero_grad zeroes them in place."""

    def __init__(self, model, setup, lr: float = 1e-3) -> None:
        import torch

        from .reference import freeze, torch_optimizer

        freeze(model, setup.optimizer.frozen)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params]
        self.main_grads = [torch.zeros_like(m) for m in self.masters] if setup.precision.fp32_grads else None
        self._hooks = []
        if self.main_grads is not None:
            for p, main in zip(self.params, self.main_grads):
                self._hooks.append(p.register_post_accumulate_grad_hook(_adder(main)))
        self.optimizer = torch_optimizer(self.masters, setup, lr)

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def host_buffers(self):  # an optimizer-state offload's host buffers (traces/tracker/ labels them)
        return getattr(self.optimizer, "host_buffers", {})

    def step(self) -> None:
        import torch

        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if self.main_grads is not None:
                m.grad = self.main_grads[i]
            else:
                m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.main_grads is not None:
            for g in self.main_grads:
                g.zero_()
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def _adder(main):
    def hook(p) -> None:
        main.add_(p.grad)
        p.grad = None
    return hook


def build_program(scenario, device: str = "cuda"):
    """(model, optimizer, batches) of the scenario's program on `device` (`check_capturable` first). A hand-written
    model is built on the host and moved, its batches left on the host (`run_loop` copies each micro-batch in);
    a traced model is built under `torch.device(device)` with its batch (its loss may close over it)."""
    import torch

    from .reference import make_optimizer

    check_capturable(scenario)
    setup = scenario.setup
    mixed = setup.precision.mixed
    built = setup.replace(precision="bf16", fp32_grads=False) if mixed else setup
    torch.manual_seed(0)
    model, batches = place_model(scenario.model, built, device)
    optimizer = MasterWeights(model, setup) if mixed else make_optimizer(model, setup)
    return model, optimizer, batches


def place_model(model_config, setup, device: str):
    """(model, batches) on `device`: a hand-written model built on the host and moved, its batches left on the
    host; a traced model built under `torch.device(device)` with its batch (its loss may close over it)."""
    import torch

    from .reference import build_model, make_batch, reference

    if reference(model_config).whole:  # (a traced model's own program: traces/reference/build.py)
        with torch.device(device):
            return build_model(model_config, setup), make_batch(model_config, setup)
    model = build_model(model_config, setup).to(device)
    if setup.float8.recipe != "none" and torch.device(device).type == "cuda":  # torch._scaled_mm, not emulated
        from .reference.float8 import device_matmuls

        model = device_matmuls(model)
    return model, make_batch(model_config, setup)


# -- the loop and its marks ---------------------------------------------------------------------------

def _now() -> float:
    return time.time_ns() / 1e9  # the clock torch's snapshot converts its `time_us` to (c10::getTime, realtime)


def _pause(seconds: float) -> None:
    time.sleep(seconds)


@dataclass
class LoopMarks:
    """The host clock at the start of each phase of the loop: (seconds, phase, step, micro-batch), then the end
    (phase None). Each mark waits for the GPU, then keeps `gap` quiet seconds on both sides of its time."""

    sync: object = None  # e.g. torch.cuda.synchronize
    gap: float = MARK_GAP_S
    marks: list = field(default_factory=list)

    def mark(self, phase: Phase | None, step: int = 0, micro_batch: int = -1) -> None:
        if self.sync is not None:
            self.sync()
        _pause(self.gap)
        self.marks.append((_now(), phase, step, micro_batch))
        _pause(self.gap)

    def as_json(self) -> list:
        return [[t, ph.value if ph else "end", s, mb] for t, ph, s, mb in self.marks]


def _peakledger_forward(model, *batch):
    return model(*batch)


def _peakledger_backward(loss):
    loss.backward()


def _peakledger_optimizer_step(optimizer):
    optimizer.step()


def _peakledger_zero_grad(optimizer, set_to_none: bool):
    optimizer.zero_grad(set_to_none=set_to_none)


def run_loop(model, optimizer, batches, setup, device: str, marks: LoopMarks) -> None:
    """The loop of traces/tracker/loop.py `training_loop`, steps numbered from 1: per micro-batch the batch copied in
    (a clone of one already on `device`), forward and loss (bf16 autocast on `device` for bf16-autocast), backward,
    the batch and outputs dropped; then the optimizer step and zero_grad. Each phase starts with a mark."""
    import torch

    autocast = setup.precision.autocast is not None
    for step in range(1, setup.batch.steps + 1):
        for mb in range(setup.batch.grad_accum):
            marks.mark(Phase.FORWARD, step, mb)
            src = batches[((step - 1) * setup.batch.grad_accum + mb) % len(batches)]
            batch = tuple(t.clone() if t.device.type == torch.device(device).type else t.to(device) for t in src)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if autocast \
                    else contextlib.nullcontext():
                out, loss = _peakledger_forward(model, *batch)
            marks.mark(Phase.BACKWARD, step, mb)
            _peakledger_backward(loss)
            del out, loss, batch
        marks.mark(Phase.OPTIMIZER, step)
        _peakledger_optimizer_step(optimizer)
        marks.mark(Phase.ZERO_GRAD, step)
        _peakledger_zero_grad(optimizer, setup.optimizer.set_to_none)
    marks.mark(None)


def label_steps(trace: SnapshotTrace, marks: list) -> dict:
    """Give every event of the trace (both views, and its OOMs) the phase, step and micro-batch of the latest
    loop mark at or before its time; the state at record start, and anything before the first mark, is the
    load (step 0). Returns what the labelling found: {"by": "loop marks", "marks": n, "outside": events of
    the trace outside the marked loop (their clock disagrees: their labels are a guess)}."""
    times = [m[0] for m in marks]
    outside = 0

    def label(e):
        nonlocal outside
        if e.op == PREEXISTING_OP:
            return dataclasses.replace(e, phase=Phase.LOAD, step=0, micro_batch_index=-1)
        k = bisect.bisect_right(times, e.time) - 1
        if k < 0 or marks[k][1] is None:
            outside += 1
            if k < 0:
                return dataclasses.replace(e, phase=Phase.LOAD, step=0, micro_batch_index=-1)
            k = max((i for i, m in enumerate(marks) if m[1] is not None), default=k)  # after the end: the last phase
        _, phase, step, mb = marks[k]
        return dataclasses.replace(e, phase=phase, step=step, micro_batch_index=mb)

    if marks:
        for log in (trace.allocated, trace.reserved):
            log.events[:] = [label(e) for e in log.events]
        trace.allocated.ooms[:] = [dataclasses.replace(o, event=label(o.event)) for o in trace.allocated.ooms]
    return {"by": "loop marks", "marks": len(marks), "outside": outside}


# -- the GPU ------------------------------------------------------------------------------------------

def allocator_rules(torch_version: str) -> str:
    """The rules of the torch that ran (simulator/torch_rules `nearest`): its own release's when modelled, else the
    newest modelled not newer ("2.12.1" -> "2.11"); the oldest for an older torch or a text that is no version."""
    try:
        return nearest(str(torch_version)).version
    except InputError:
        return RULES[0].version


def gpu_profile(capability, total_memory: int | None = None) -> str | None:
    """The peakledger device profile of a GPU: the CUDA profiles of its compute capability, the one whose memory
    is nearest the GPU's (9.0 is both H100-80GB and H200-141GB); None when no profile has that capability."""
    cc = tuple(capability) if capability is not None else None
    same = [p for p in DEVICES.values() if p.is_cuda and p.compute_capability == cc]
    if not same:
        return None
    if total_memory is None:
        return same[0].name
    return min(same, key=lambda p: abs(p.memory_bytes - total_memory)).name


def cuda_device() -> dict:
    """The GPU this process sees (device 0): name, compute capability, total and free memory, its profile, the
    torch version and its allocator rules, PYTORCH_CUDA_ALLOC_CONF. ConfigError naming `device_kind` without one."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("device_kind", f"cuda capture needs a CUDA GPU; torch {torch.__version__} sees none here. "
                                         "Run it on a GPU machine, or use --device-kind cpu")
    cc = tuple(torch.cuda.get_device_capability(0))
    free, total = torch.cuda.mem_get_info(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": list(cc), "total_memory": int(total),
            "free_memory": int(free), "profile": gpu_profile(cc, total), "torch": torch.__version__,
            "allocator_rules": allocator_rules(torch.__version__),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))}


# -- the capture --------------------------------------------------------------------------------------

def capture_cuda(scenario, snapshot_path: str | Path, max_entries: int = MAX_ENTRIES,
                 device: dict | None = None) -> SnapshotTrace:
    """Run the scenario's program on cuda:0 under the allocator's history; the snapshot trace, labelled by the
    loop's marks, its metadata the scenario and the GPU (`device`: `cuda_device()`, found here if not given)."""
    import torch

    check_capturable(scenario)
    device = device or cuda_device()
    setup = scenario.setup
    model, optimizer, batches = build_program(scenario, "cuda")
    torch.cuda.synchronize()
    marks = LoopMarks(sync=torch.cuda.synchronize)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="all")
    try:
        run_loop(model, optimizer, batches, setup, "cuda", marks)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(snapshot_path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del model, optimizer, batches
    trace = load_snapshot(snapshot_path)
    labels = label_steps(trace, marks.marks)
    reserved_peak = trace.reserved_peak_bytes(allow_truncated=True)
    meta = RunMetadata(torch_version=device["torch"], device=device["name"], device_kind="cuda", cuda_device=0,
                       gpu=device["name"], compute_capability=list(device["compute_capability"]),
                       gpu_total_memory=device["total_memory"], gpu_profile=device["profile"],
                       device_profile=device["profile"], allocator_rules=device["allocator_rules"],
                       alloc_conf=device["alloc_conf"], model=as_keys(scenario.model),
                       model_kind=type(scenario.model).__name__, setup=setup,
                       scenario=scenario.name, source_pickle=Path(snapshot_path).name, reserved_peak=reserved_peak,
                       step_labels=labels, loop_marks=marks.as_json())
    trace.allocated.metadata = trace.allocated.metadata.updated(meta)
    trace.reserved.metadata = trace.reserved.metadata.updated(meta)
    return trace


def is_cuda_trace(log: EventLog) -> bool:
    """A measured log of a CUDA run: a `capture --device-kind cuda` trace or a CUDA snapshot."""
    return log.source.startswith("cuda-snapshot") or log.metadata.device_kind == "cuda"


__all__ = ["capture_cuda", "build_program", "check_capturable", "MasterWeights", "LoopMarks", "run_loop",
           "label_steps", "allocator_rules", "gpu_profile", "cuda_device",
           "is_cuda_trace", "CAPTURE_PRECISIONS"]
