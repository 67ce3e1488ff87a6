"""Where a training script is: its phase, optimizer step and micro-batch, learnt from what it calls.

A user's script is not our loop: the step structure is discovered, not assumed. While a script runs, torch's and
the libraries' entry points say where it is:
- a call of a top-level `nn.Module` (no module running) with autograd on and the module in training mode starts a
  micro-batch's FORWARD; the loss computed after it is still forward;
- `Tensor.backward` / `torch.autograd.backward` (accelerate's `backward`, HF Trainer's, Lightning's all end there):
  BACKWARD of that micro-batch; the micro-batches of a step are counted by the backward calls between two
  optimizer steps (a script accumulating 4 micro-batches shows 4);
- `Optimizer.step` (torch's global step hooks, so a wrapped optimizer, accelerate's or DeepSpeed's, counts once:
  the innermost torch optimizer) is OPTIMIZER; a closure it is given (Lightning's `optimizer.step(closure)`)
  runs as training code, its forward and backward seen as such; `torch.nn.utils.clip_grad_norm_` before it is
  counted there too;
- gradient clipping (`torch.nn.utils.clip_grad_norm_`, its `get_total_norm` / `clip_grads_with_norm_`, accelerate's
  `Accelerator.clip_grad_norm_`): OPTIMIZER, counted as a clip;
- `Optimizer.zero_grad` / `Module.zero_grad`: ZERO_GRAD of the step that has run;
- a top-level module called without autograd or in eval mode: EVAL (evaluation loops, metrics, a reference
  model's forward in DPO);
- work between an optimizer step and the next training forward (a zero_grad, logging, an eval, a save, GRPO's
  generation of the next batch) is the finished step's;
- `torch.save` and safetensors' `save_file` / `save_model`: CHECKPOINT, for the call;
- transformers' `GenerationMixin.generate`: GENERATE for its own work (inputs expanded for
  num_return_sequences, the cache made), PREFILL from its `_prefill` (the prompt's forward) until the first later
  forward of the model, DECODE from there until generate returns (models/generation/ explains the program);
- TRL's trainers (trl 1.16.0): GRPO's `_generate_and_score_completions` starts the next step's ROLLOUT, which goes
  on until the update's forward (the buffer split after it included); its `_generate_single_turn` is GENERATE
  (HF generate's PREFILL / DECODE inside it); `_get_per_token_logps_and_entropies` under no_grad is REFERENCE for
  the trainer's `ref_model`, else OLD_LOGPROBS; DPO's `_compute_loss` names its `ref_model`, whose top-level calls
  are REFERENCE for the call (the position before comes back after). A PEFT reference pass (the policy with its
  adapter disabled) is not told apart: OLD_LOGPROBS in GRPO, EVAL in DPO;
- what transformers' `Cache.update` leaves in a layer's keys / values is labelled KV_CACHE (`on_label`), and what
  HF Trainer's evaluation loop accumulates (`EvalLoopContainer.add`: preds_host, labels, losses) PREDICTIONS.
Module calls made inside backward (activation checkpointing's recompute) or inside generate change nothing else.

The run stops at the first training forward after `steps` optimizer steps (`StopScript`): what the script does
after its last counted step (its eval, its save) is in the run; its next step is not.

`ScriptPhases` is shared by the prediction (models/script/record.py, fake tensors) and the measurement
(traces/script_run.py, real tensors under the tracker): both see the same positions from the same calls.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ...simulator.events import Category, Phase


class StopScript(BaseException):
    """Raised at the first training forward after the last counted optimizer step: the run ends there."""


@dataclass(frozen=True)
class Position:
    phase: Phase
    step: int
    micro_batch: int


@dataclass
class Calls:
    """What the script did, counted: the report's description of its loop."""

    forwards: int = 0
    backwards: int = 0
    optimizer_steps: int = 0
    zero_grads: int = 0
    evals: int = 0
    saves: int = 0
    generates: int = 0
    clips: int = 0
    outputs_held: int = 0  # backward calls that began with the forward's non-scalar outputs still referenced
    micro_batches: list[int] = field(default_factory=list)  # backward calls of each optimizer step
    optimizers: list[str] = field(default_factory=list)  # class names, in the order first stepped
    models: list[str] = field(default_factory=list)  # top-level modules' classes, in the order first called


class ScriptPhases:
    """Patches and global hooks that track the script's position (use as a context manager).

    `on_position(position)`: the position changed (before the work of the new one runs). `on_scan(models,
    optimizers)`: after a backward, an optimizer step or a zero_grad, to label gradients and optimizer states.
    `on_inputs(tensors)`: the tensors a training or eval forward is given (the batch). `on_module(name | None)`:
    the module running now (its path; None: none), at each module's start and end. `on_label(tensor, category,
    name, state)`: label a tensor the libraries hold (a KV cache layer, an eval's accumulated outputs), as
    `label_state`'s callback. `steps`: stop after this many optimizer steps (None: run to the end)."""

    def __init__(self, steps: int | None, on_position: Callable[[Position], None],
                 on_scan: Callable[[list, list], None], on_inputs: Callable[[list], None],
                 on_module: Callable[[str | None], None], on_label: Callable | None = None) -> None:
        self.steps = steps
        self.on_position, self.on_scan, self.on_inputs, self.on_module = on_position, on_scan, on_inputs, on_module
        self.on_label = on_label if on_label is not None else (lambda t, category, name, state: None)
        self.generating = 0  # depth of generate calls running
        self.prefilled = False  # generate's prefill forward has returned
        self.references: set[int] = set()  # ids of the RL trainers' reference models
        self.rl_pass: Phase | None = None  # a no_grad scoring pass running (its top-level calls keep its phase)
        self.position = Position(Phase.LOAD, 0, -1)
        self.calls = Calls()
        self.models: dict[int, torch.nn.Module] = {}  # id -> each top-level module called
        self.names: dict[int, dict[int, str]] = {}  # id(top) -> id(submodule) -> path
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.stack: list[str] = []
        self._names: dict[int, str] = {}
        self._outputs: list[weakref.ref] = []  # the last training forward's non-scalar outputs
        self.step = 0  # the step the script is in: 1 from its first training forward (0: before it, loading)
        self.done = 0  # optimizer steps completed
        self.in_step = 0  # backward calls since the last optimizer step
        self.inside = 0  # depth of calls that hide module calls (backward, generate, an optimizer step)
        self._stack: contextlib.ExitStack | None = None

    # -- position -------------------------------------------------------------------------------------
    def _move(self, phase: Phase, step: int, micro_batch: int) -> None:
        position = Position(phase, step, micro_batch)
        if position != self.position:
            self.position = position
            self.on_position(position)

    @contextlib.contextmanager
    def _during(self, phase: Phase, micro_batch: int = -1, hide: bool = True) -> Iterator[None]:
        """The call is `phase`; the position before it comes back after (a save, a generate)."""
        before = self.position
        self._move(phase, self.step, micro_batch)
        self.inside += hide
        try:
            yield
        finally:
            self.inside -= hide
            self._move(before.phase, before.step, before.micro_batch)

    # -- modules ----------------------------------------------------------------------------------------
    def _call(self, original: Callable) -> Callable:
        """`nn.Module._call_impl` (every module call, with its keyword arguments) wrapped: the top-level call
        decides the position; every call names the work inside it by its module path."""
        @functools.wraps(original)
        def call(module, *args, **kwargs):
            top = not self.stack and not self.inside
            restore = None
            if not self.stack and self.generating and self.position.phase is Phase.PREFILL and self.prefilled:
                self._move(Phase.DECODE, self.step, -1)  # generate's first forward after its prefill
            if not self.stack:
                if top:
                    before = self.position
                    self._top_level(module, args, kwargs)
                    if self.position.phase is Phase.REFERENCE and self.rl_pass is None:
                        restore = before  # DPO's reference forward, inside the step's forward
                key = id(module)
                if key not in self.names:
                    cls = type(module).__name__
                    self.names[key] = {id(m): (f"{cls}.{n}" if n else cls) for n, m in module.named_modules()}
                self._names = self.names[key]
            name = self._names.get(id(module)) or f"{self.stack[-1] if self.stack else ''}.{type(module).__name__}"
            self.stack.append(name)
            self.on_module(name)
            try:
                out = original(module, *args, **kwargs)
            finally:
                self.stack.pop()
                self.on_module(self.stack[-1] if self.stack else None)
            if restore is not None:
                self._move(restore.phase, restore.step, restore.micro_batch)
            if top and self.position.phase is Phase.FORWARD:  # what the caller holds of it, watched until backward
                self._outputs = [weakref.ref(t) for t in _output_tensors(out) if t.dim() > 0]
            return out
        return call

    def _top_level(self, module: torch.nn.Module, args, kwargs: dict) -> None:
        if id(module) not in self.models:
            self.models[id(module)] = module
            self.calls.models.append(type(module).__name__)
        training = torch.is_grad_enabled() and module.training
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if training:
            if self.steps is not None and self.done >= self.steps:
                raise StopScript()
            self._new_step()
            self.calls.forwards += 1
            self._move(Phase.FORWARD, self.step, self.in_step)
        else:
            self.calls.evals += 1
            phase = Phase.REFERENCE if id(module) in self.references else (self.rl_pass or Phase.EVAL)
            self._move(phase, self.step, -1)
        self.on_inputs(tensors)

    def _new_step(self) -> None:
        """Training work after an optimizer step (or the first) is the next step's: steps count from 1."""
        if self.step != self.done + 1:
            self.step, self.in_step = self.done + 1, 0

    # -- backward, optimizer, zero_grad, clip, save, generate ------------------------------------------------
    def _backward(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def backward(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            self._new_step()
            self.calls.backwards += 1
            if any(ref() is not None for ref in self._outputs):  # the forward's outputs (its logits) still held
                self.calls.outputs_held += 1
            self._outputs = []
            self._move(Phase.BACKWARD, self.step, self.in_step)
            self.inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.inside -= 1
                self.in_step += 1
                self.on_scan(list(self.models.values()), list(self.optimizers.values()))
        return backward

    def _step_pre(self, optimizer, args, kwargs):
        if self.inside:
            return None
        if id(optimizer) not in self.optimizers:
            self.optimizers[id(optimizer)] = optimizer
            self.calls.optimizers.append(type(optimizer).__name__)
        self._new_step()
        self._move(Phase.OPTIMIZER, self.step, -1)
        self.inside += 1
        closure = kwargs.get("closure", args[0] if args else None)
        if callable(closure):  # Lightning's `optimizer.step(closure)`: the forward and backward run inside the step
            wrapped = self._closure(closure)
            return ((wrapped, *args[1:]), kwargs) if "closure" not in kwargs else (args, {**kwargs, "closure": wrapped})
        return None

    def _closure(self, closure: Callable) -> Callable:
        """The step's closure runs as the script's own training code (its forward and backward are seen); the
        optimizer step goes on after it."""
        @functools.wraps(closure)
        def run(*args, **kwargs):
            inside, self.inside = self.inside, 0
            try:
                return closure(*args, **kwargs)
            finally:
                self.inside = inside
                self._move(Phase.OPTIMIZER, self.step, -1)
        return run

    def _step_post(self, optimizer, args, kwargs) -> None:
        if self.inside != 1:
            return
        self.inside -= 1
        self.done += 1
        self.calls.optimizer_steps += 1
        self.calls.micro_batches.append(self.in_step)
        self.on_scan(list(self.models.values()), list(self.optimizers.values()))

    def _zero_grad(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def zero_grad(obj, *args, **kwargs):
            if self.inside:
                return original(obj, *args, **kwargs)
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self.optimizers:
                self.optimizers[id(obj)] = obj
                self.calls.optimizers.append(type(obj).__name__)
            self.calls.zero_grads += 1
            self._move(Phase.ZERO_GRAD, self.step, -1)
            self.inside += 1
            try:
                return original(obj, *args, **kwargs)
            finally:
                self.inside -= 1
                self.on_scan(list(self.models.values()), list(self.optimizers.values()))
        return zero_grad

    def _clip(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def clip(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            self.calls.clips += 1
            self._move(Phase.OPTIMIZER, self.step, -1)
            self.inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.inside -= 1
        return clip

    def _around(self, original: Callable, phase: Phase, counter: str) -> Callable:
        @functools.wraps(original)
        def call(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            setattr(self.calls, counter, getattr(self.calls, counter) + 1)
            with self._during(phase):
                return original(*args, **kwargs)
        return call

    # -- generate's phases, its KV cache, an evaluation's accumulated outputs -----------------------------------
    def _generate(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def generate(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            self.calls.generates += 1
            self.generating += 1
            try:
                with self._during(Phase.GENERATE):
                    return original(*args, **kwargs)
            finally:
                self.generating -= 1
        return generate

    def _prefill(self, original: Callable) -> Callable:
        """generate's `_prefill`: PREFILL, which goes on after it (the first token chosen) until the next forward."""
        @functools.wraps(original)
        def prefill(*args, **kwargs):
            if not self.generating:
                return original(*args, **kwargs)
            self.prefilled = False
            self._move(Phase.PREFILL, self.step, -1)
            out = original(*args, **kwargs)
            self.prefilled = True
            return out
        return prefill

    def _cache_update(self, original: Callable) -> Callable:
        """`Cache.update(key_states, value_states, layer_idx)`: the layer's keys and values after it are the cache."""
        @functools.wraps(original)
        def update(cache, key_states, value_states, layer_idx, *args, **kwargs):
            out = original(cache, key_states, value_states, layer_idx, *args, **kwargs)
            layer = cache.layers[layer_idx]
            for part in ("keys", "values"):
                t = getattr(layer, part, None)
                if isinstance(t, torch.Tensor):
                    self.on_label(t, Category.KV_CACHE, f"kv_cache.layers.{layer_idx}.{part}", None)
            return out
        return update

    def _accumulated(self, original: Callable) -> Callable:
        """HF Trainer's `EvalLoopContainer.add`: what it holds after it (nested_concat's result) is PREDICTIONS."""
        @functools.wraps(original)
        def add(container, tensors):
            out = original(container, tensors)
            for t in _output_tensors(container.tensors):
                self.on_label(t, Category.PREDICTIONS, "eval.accumulated", None)
            return out
        return add

    # -- TRL's RL trainers: rollout, reference and old log-prob passes ---------------------------------------
    def _rollout(self, original: Callable) -> Callable:
        """GRPOTrainer._generate_and_score_completions: the next step's ROLLOUT (a run of `steps` steps stops here)."""
        @functools.wraps(original)
        def rollout(trainer, *args, **kwargs):
            if self.inside:
                return original(trainer, *args, **kwargs)
            self._reference(trainer)
            if getattr(trainer.model, "training", False):
                if self.steps is not None and self.done >= self.steps:
                    raise StopScript()
                self._new_step()
            self._move(Phase.ROLLOUT, self.step, -1)
            return original(trainer, *args, **kwargs)
        return rollout

    def _rl_generate(self, original: Callable) -> Callable:
        """GRPOTrainer._generate_single_turn: GENERATE (TRL's padding and masking around HF generate's phases)."""
        @functools.wraps(original)
        def generate(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            with self._during(Phase.GENERATE, hide=False):
                return original(*args, **kwargs)
        return generate

    def _logprobs(self, original: Callable) -> Callable:
        """GRPOTrainer._get_per_token_logps_and_entropies(model, ...) under no_grad: REFERENCE for the trainer's
        ref_model, OLD_LOGPROBS for the policy; with autograd on it is the update's forward."""
        @functools.wraps(original)
        def logprobs(trainer, model, *args, **kwargs):
            if self.inside or torch.is_grad_enabled():
                return original(trainer, model, *args, **kwargs)
            self._reference(trainer)
            ref = getattr(trainer, "ref_model", None)
            phase = Phase.REFERENCE if ref is not None and model is ref else Phase.OLD_LOGPROBS
            outer, self.rl_pass = self.rl_pass, phase
            try:
                with self._during(phase, hide=False):
                    return original(trainer, model, *args, **kwargs)
            finally:
                self.rl_pass = outer
        return logprobs

    def _dpo_loss(self, original: Callable) -> Callable:
        """DPOTrainer._compute_loss: its ref_model's forward inside is REFERENCE."""
        @functools.wraps(original)
        def compute_loss(trainer, *args, **kwargs):
            self._reference(trainer)
            return original(trainer, *args, **kwargs)
        return compute_loss

    def _reference(self, trainer) -> None:
        ref = getattr(trainer, "ref_model", None)
        if isinstance(ref, torch.nn.Module):
            self.references.add(id(ref))

    # -- the patches ----------------------------------------------------------------------------------------
    def __enter__(self) -> "ScriptPhases":
        stack = self._stack = contextlib.ExitStack()
        self._patch(torch.nn.Module, "_call_impl", self._call)
        step_pre = register_optimizer_step_pre_hook(self._step_pre)
        step_post = register_optimizer_step_post_hook(self._step_post)
        for handle in (step_pre, step_post):
            stack.callback(handle.remove)
        self._patch(torch.Tensor, "backward", self._backward)
        self._patch(torch.autograd, "backward", self._backward)
        self._patch(torch.optim.Optimizer, "zero_grad", self._zero_grad)
        self._patch(torch.nn.Module, "zero_grad", self._zero_grad)
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):  # (the names scripts and libraries call)
            for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_"):
                self._patch(owner, name, self._clip)
        accelerator = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
        if accelerator is not None:  # accelerate's own (a norm per device mesh, then clip_grads_with_norm_)
            self._patch(accelerator, "clip_grad_norm_", self._clip)
        self._patch(torch, "save", lambda f: self._around(f, Phase.CHECKPOINT, "saves"))
        wraps = {"generate": self._generate, "_prefill": self._prefill, "update": self._cache_update,
                 "add": self._accumulated, "_generate_and_score_completions": self._rollout,
                 "_generate_single_turn": self._rl_generate, "_get_per_token_logps_and_entropies": self._logprobs,
                 "_compute_loss": self._dpo_loss}
        for module, names in _library_calls():
            for name in names:
                wrap = wraps.get(name) or (lambda f: self._around(f, Phase.CHECKPOINT, "saves"))
                self._patch(module, name, wrap)
        return self

    def _patch(self, owner, name: str, wrap: Callable[[Callable], Callable]) -> None:
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None:
            return
        setattr(owner, name, wrap(original))
        self._stack.callback(setattr, owner, name, original)

    def __exit__(self, *exc) -> None:
        self._stack.close()


def _output_tensors(out) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, a tuple / list, a dict (HF's ModelOutput is one)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _output_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _output_tensors(v)]
    return []


def _library_calls() -> list[tuple[object, tuple[str, ...]]]:
    """The libraries' own save and generate entry points, where they are imported (importing them is not ours to
    do: a script that never imports transformers does not pay for it)."""
    import sys

    found = []
    st = sys.modules.get("safetensors.torch")
    if st is not None:
        found.append((st, ("save_file", "save_model")))
    generation = sys.modules.get("transformers.generation.utils")
    if generation is not None:
        found.append((generation.GenerationMixin, ("generate", "_prefill")))
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache is not None:
        found.append((cache, ("update",)))
    container = getattr(sys.modules.get("transformers.trainer_pt_utils"), "EvalLoopContainer", None)
    if container is not None:
        found.append((container, ("add",)))
    grpo = getattr(sys.modules.get("trl.trainer.grpo_trainer"), "GRPOTrainer", None)
    if grpo is not None:  # trl 1.16.0 trainer/grpo_trainer.py:1419, :1763, :2324
        found.append((grpo, ("_generate_and_score_completions", "_generate_single_turn",
                             "_get_per_token_logps_and_entropies")))
    dpo = getattr(sys.modules.get("trl.trainer.dpo_trainer"), "DPOTrainer", None)
    if dpo is not None:  # trl 1.16.0 trainer/dpo_trainer.py:1285
        found.append((dpo, ("_compute_loss",)))
    for module, cls, names in (("transformers.modeling_utils", "PreTrainedModel", ("save_pretrained",)),
                               ("transformers.trainer", "Trainer", ("_save_checkpoint", "save_model")),
                               ("accelerate.accelerator", "Accelerator", ("save_state", "save_model")),
                               ("lightning.pytorch.trainer.trainer", "Trainer", ("save_checkpoint",))):
        owner = getattr(sys.modules.get(module), cls, None)
        if owner is not None:
            found.append((owner, names))
    return found
