"""TRL's DPOTrainer and GRPOTrainer run for real on the CPU under the allocation tracker, phase by phase.

The ground truth for issue 40's RL phases (docs/rl.md "What TRL's trainers hold, phase by phase"): the user script
examples/scripts/trl_rl.py (a tiny random Qwen2 built from a config dict, the project's tiny tokenizer, no download)
run as it is, in peakledger run's script world (models/script/run.py `script_context`), under the allocation
tracker. The policy is given by path, so the trainer builds its reference model from the same folder (trl 1.16.0
dpo_trainer.py:908-927, grpo_trainer.py:983-1003). The trainer runs unmodified; when it is built, its methods are
wrapped only to say where it is:

  GRPO  _prepare_inputs when it generates .......... rollout.score     (padding, advantages, the buffer split)
        _generate_single_turn (HF generate) ........ rollout.generate
        _get_per_token_logps_and_entropies, no grad  rollout.old_logprobs (the policy) / rollout.ref_logprobs
        _calculate_rewards ......................... rollout.reward
        compute_loss ............................... update.forward
  DPO   compute_loss ............................... update.forward    (chosen + rejected in one forward, the loss)
        the reference model's forward inside it .... update.ref_forward
  both  accelerator.backward ....................... update.backward
        _clip_grad_norm, optimizer.step, lr step ... optimizer
        model.zero_grad ............................ zero_grad
        the trainer's construction ................. load (the reference model's load, the optimizer's creation)
        anything else (data loading, logging) ...... other (its events keep the phase of the call before)

Each label is also a schema phase (`LABEL_PHASES`), written on every event, so the log is comparable with a
`peakledger run` of the same script; the labels themselves are kept beside the log (`TrlRun.labels`, one per
event). A phase's peak is the highest running total of live bytes while it runs, counting what it holds on entry.
Generated lengths are fixed (min_new_tokens = max_new_tokens: generate masks EOS until then) and every prompt,
chosen and rejected text has the same token length, so the bytes do not depend on what is sampled.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...simulator.events import Category, EventLog, Phase
from ...simulator.run_metadata import RunMetadata
from ..tracker import AllocationTracker

LABEL_PHASES = {  # the schema's phase of each label (peakledger run names the same calls the same way)
    "load": Phase.LOAD,
    "rollout.score": Phase.ROLLOUT,
    "rollout.generate": Phase.GENERATE,  # peakledger run splits HF generate into GENERATE / PREFILL / DECODE
    "rollout.old_logprobs": Phase.OLD_LOGPROBS,
    "rollout.ref_logprobs": Phase.REFERENCE,
    "rollout.reward": Phase.ROLLOUT,
    "update.forward": Phase.FORWARD,
    "update.ref_forward": Phase.REFERENCE,
    "update.backward": Phase.BACKWARD,
    "optimizer": Phase.OPTIMIZER,
    "zero_grad": Phase.ZERO_GRAD,
}


SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "scripts" / "trl_rl.py"


@dataclass(frozen=True)
class TrlCase:
    """One measured run of examples/scripts/trl_rl.py (its flags). `micro_batch`: DPO pairs, or GRPO completions, per
    micro-batch; `prompt_tokens`, `completion_tokens`: every prompt's and every completion's (DPO: chosen and
    rejected, before TRL's EOS) length. `bf16` and `gradient_checkpointing` are TRL's defaults (dpo_config.py:148-149);
    False gives the plain fp32 step."""

    trainer: str  # "dpo" | "grpo"
    steps: int = 2
    micro_batch: int = 2
    grad_accum: int = 1
    prompt_tokens: int = 8
    completion_tokens: int = 8
    num_generations: int = 2  # GRPO
    num_iterations: int = 1  # GRPO
    beta: float = 0.1
    bf16: bool = False
    gradient_checkpointing: bool = False

    @property
    def name(self) -> str:
        parts = [self.trainer, f"mb{self.micro_batch}"]
        if self.grad_accum > 1:
            parts.append(f"ga{self.grad_accum}")
        if self.trainer == "grpo":
            parts.append(f"g{self.num_generations}")
            if self.num_iterations > 1:
                parts.append(f"it{self.num_iterations}")
        parts.append("bf16" if self.bf16 else "fp32")
        if self.gradient_checkpointing:
            parts.append("gc")
        return "-".join(parts)

    def argv(self, model: str) -> list[str]:
        """The script's arguments for this case, its model folder `model`."""
        out = ["--model", model, "--trainer", self.trainer]
        for flag in ("steps", "micro_batch", "grad_accum", "prompt_tokens", "completion_tokens", "num_generations",
                     "num_iterations", "beta"):
            out += ["--" + flag.replace("_", "-"), str(getattr(self, flag))]
        out += ["--bf16"] * self.bf16 + ["--gradient-checkpointing"] * self.gradient_checkpointing
        return out


@dataclass
class TrlRun:
    case: TrlCase
    log: EventLog
    labels: list[str]  # one per event of `log`
    steps: list[int]  # one per event: the optimizer step it belongs to (0: load)
    facts: dict = field(default_factory=dict)  # shapes and sizes read from the real run (the trainer's own tensors)

    def phase_peaks(self) -> dict[tuple[str, int], int]:
        """(label, step) -> its peak (`label_peaks`)."""
        return label_peaks(self.log.events, self.labels, self.steps)

    def peak(self) -> int:
        running = best = 0
        for e in self.log.events:
            running += e.delta
            best = max(best, running)
        return best

    def live_by_category(self, label: str, step: int) -> dict[Category, int]:
        """Bytes live by category at the moment (label, step) reaches its peak."""
        target = self.phase_peaks()[(label, step)]
        live: dict[Category, int] = {}
        running = 0
        entered = False
        for e, lab, s in zip(self.log.events, self.labels, self.steps):
            if (lab, s) == (label, step) and not entered:
                entered = True
                if running == target:
                    return {c: b for c, b in live.items() if b}
            running += e.delta
            live[e.block.category] = live.get(e.block.category, 0) + e.delta
            if (lab, s) == (label, step) and running == target:
                return {c: b for c, b in live.items() if b}
        raise KeyError((label, step))


def label_peaks(events, labels: list[str], steps: list[int]) -> dict[tuple[str, int], int]:
    """(label, step) -> the highest running total of live bytes while that label ran, what is live when it is
    entered included; `labels` and `steps` say where each of `events` happened."""
    out: dict[tuple[str, int], int] = {}
    running = 0
    previous = None
    for e, label, step in zip(events, labels, steps):
        key = (label, step)
        if key != previous:
            out[key] = max(out.get(key, 0), running)
            previous = key
        running += e.delta
        out[key] = max(out[key], running)
    return out


class _Clock:
    """Where the trainer is: a stack of labels, each switch written on the tracker (its phase) and remembered at
    the index of the next event."""

    def __init__(self, tracker: AllocationTracker, trainer) -> None:
        self.tracker = tracker
        self.trainer = trainer
        self.stack: list[tuple[str, int, int]] = []
        self.switches: list[tuple[int, str, int]] = []  # (first event index, label, step)
        self.micro_batch = 0
        self._switch("load", 0, -1)

    def _switch(self, label: str, step: int, mb: int) -> None:
        if label != "other":  # between labelled calls (data loading, logging): the phase of the call before
            self.tracker.phase_state = (LABEL_PHASES[label], step, mb)
        self.switches.append((len(self.tracker.raw), label, step))

    @contextlib.contextmanager
    def label(self, label: str):
        step = self.trainer.state.global_step + 1
        entry = (label, step, self.micro_batch)
        self.stack.append(entry)
        self._switch(*entry)
        try:
            yield
        finally:
            self.stack.pop()
            self._switch(*(self.stack[-1] if self.stack else ("other", step, self.micro_batch)))

    def per_event(self, n: int) -> tuple[list[str], list[int]]:
        labels, steps = [], []
        switches = self.switches + [(n, "", 0)]
        for (start, label, step), (end, _, _) in zip(switches, switches[1:]):
            labels += [label] * (end - start)
            steps += [step] * (end - start)
        return labels, steps


def _wrap(obj, name: str, around):
    """Replace bound method `name` of `obj` (the instance attribute) by `around(original, *args, **kwargs)`."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return around(original, *args, **kwargs)

    setattr(obj, name, wrapper)


def _labelled(clock: _Clock, label: str):
    def around(original, *args, **kwargs):
        with clock.label(label):
            return original(*args, **kwargs)
    return around


def _instrument(clock: _Clock, trainer, facts: dict) -> None:
    tracker = clock.tracker
    policy, ref = trainer.model, trainer.ref_model
    _wrap(trainer, "compute_loss", _labelled(clock, "update.forward"))

    def backward(original, loss, **kwargs):
        with clock.label("update.backward"):
            original(loss, **kwargs)
            tracker.scan()
    _wrap(trainer.accelerator, "backward", backward)

    def training_step(original, *args, **kwargs):
        out = original(*args, **kwargs)
        clock.micro_batch += 1
        return out
    _wrap(trainer, "training_step", training_step)
    _wrap(trainer, "_clip_grad_norm", _labelled(clock, "optimizer"))

    def zero_grad(original, *args, **kwargs):
        with clock.label("zero_grad"):
            original(*args, **kwargs)
            tracker.scan()
        clock.micro_batch = 0
    _wrap(policy, "zero_grad", zero_grad)

    if trainer.__class__.__name__ == "DPOTrainer":
        if ref is not None:
            _wrap(ref, "forward", _labelled(clock, "update.ref_forward"))

        def dpo_loss(original, model, inputs, *args, **kwargs):
            facts.setdefault("dpo_input_ids", list(inputs["input_ids"].shape))
            return original(model, inputs, *args, **kwargs)
        _wrap(trainer, "_compute_loss", dpo_loss)
        return

    def prepare(original, batch):
        generating = trainer._step % (trainer.args.steps_per_generation * trainer.num_iterations) == 0 \
            or trainer._buffered_inputs is None
        with clock.label("rollout.score") if generating else contextlib.nullcontext():
            out = original(batch)
        if generating:
            facts.setdefault("buffer", [{k: list(v.shape) for k, v in b.items() if torch.is_tensor(v) and v.dim()}
                                        for b in trainer._buffered_inputs])
        return out
    _wrap(trainer, "_prepare_inputs", prepare)
    _wrap(trainer, "_generate_single_turn", _labelled(clock, "rollout.generate"))
    _wrap(trainer, "_calculate_rewards", _labelled(clock, "rollout.reward"))

    def logps(original, model, *args, **kwargs):
        if torch.is_grad_enabled():
            return original(model, *args, **kwargs)
        label = "rollout.ref_logprobs" if model is ref else "rollout.old_logprobs"
        with clock.label(label):
            return original(model, *args, **kwargs)
    _wrap(trainer, "_get_per_token_logps_and_entropies", logps)


def make_model(folder: str) -> None:
    """The script's tiny random Qwen2 and tokenizer, written to `folder` (the script's own --make-model)."""
    from ...models.script.run import run_path, script_context

    with script_context(SCRIPT, ["--make-model", os.path.abspath(folder)]):
        run_path(SCRIPT, None)


def measure(case: TrlCase, model: str) -> TrlRun:
    """Run examples/scripts/trl_rl.py for `case` (its model folder `model`, from `make_model`) for real under the
    tracker, in peakledger run's script world (a scratch folder, offline); the trainer is instrumented when it is
    built (its class's __init__ patched for the run)."""
    from trl import DPOTrainer, GRPOTrainer

    from ...models.script.run import run_path, script_context

    tracker = AllocationTracker(discover_inputs=True)
    facts: dict = {}
    clocks: list[_Clock] = []
    originals = {cls: cls.__init__ for cls in (DPOTrainer, GRPOTrainer)}

    def patched(cls):
        def __init__(self, *args, **kwargs):
            originals[cls](self, *args, **kwargs)
            clock = clocks[0]
            clock.trainer = self
            _label_models(tracker, self)
            self.create_optimizer()
            tracker.optimizer = self.optimizer
            self.optimizer.register_step_post_hook(lambda *_: tracker.scan())
            _wrap(self.optimizer, "step", _labelled(clock, "optimizer"))
            _instrument(clock, self, facts)
            facts.update(_model_facts(self))
        return __init__

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cls in originals:
            cls.__init__ = patched(cls)
        with script_context(SCRIPT, case.argv(os.path.abspath(model))):
            with tracker:
                clocks.append(_Clock(tracker, trainer=None))
                run_path(SCRIPT, None)
    finally:
        for cls, init in originals.items():
            cls.__init__ = init
        torch.set_num_threads(threads)
    log = tracker.log(RunMetadata(steps=case.steps, grad_accum=case.grad_accum, optimizer="AdamW",
                                  source="torch-dispatch-tracker (traces/reference/trl_run.py)",
                                  autocast="torch.bfloat16" if case.bf16 else None, script=SCRIPT.name))
    labels, steps = clocks[0].per_event(len(log.events))
    return TrlRun(case=case, log=log, labels=labels, steps=steps, facts=facts)


def _label_models(tracker: AllocationTracker, trainer) -> None:
    """The policy's and the reference model's weights: PARAMETER `policy.<name>` / `ref.<name>` (BUFFER for
    buffers), and their module names for what their forwards allocate."""
    models = {"policy": trainer.model, "ref": trainer.ref_model}
    tracker.model = trainer.model
    for prefix, model in models.items():
        if model is None:
            continue
        for n, p in model.named_parameters():
            tracker.mark(p, Category.PARAMETER, name=f"{prefix}.{n}")
        for n, b in model.named_buffers():
            tracker.mark(b, Category.BUFFER, name=f"{prefix}.{n}")
        for name, mod in model.named_modules():
            tracker._hooks.append(mod.register_forward_pre_hook(tracker._pre_hook(f"{prefix}.{name}" if name
                                                                                  else prefix)))
            tracker._hooks.append(mod.register_forward_hook(tracker._post_hook()))
    tracker.param_names = {id(p): f"policy.{n}" for n, p in trainer.model.named_parameters()}


def _model_facts(trainer) -> dict:
    def size(model):
        if model is None:
            return None
        return {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
                "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}
    return {"policy": size(trainer.model), "ref": size(trainer.ref_model)}


__all__ = ["TrlCase", "TrlRun", "measure", "label_peaks", "make_model", "LABEL_PHASES", "SCRIPT"]
