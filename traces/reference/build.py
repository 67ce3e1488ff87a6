"""The pieces of a real training run on a reference model: the model built as a setup says (`build_model`),
its frozen parameters, the torch optimizer (with an optimizer-state offload, `StateOffload`), and the batches.

Each model family's real program is registered here against its family object (`PROGRAMS`: models/families/ holds
the rest of the family, and cannot import this layer): a traced model's own (traced.py), HF's Mixtral (mixtral.py),
HF's GPT-2 or nanoGPT / Llama / MLP (nanogpt.py). `build_model` builds the model's family's program, then the
setup's dtype and peft's LoRA / QLoRA (lora.py) on top; `make_batch` makes its batches.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...models import families
from ...models.config import ConfigError, TrainingSetup
from ...models.families import Family, family_of
from ...models.optimizers import OPTIMIZERS, offload_chunks
from .float8 import apply_float8
from .lora import apply_lora
from .mixtral import hf_mixtral
from .nanogpt import GPT, MLP, REFERENCE_PRECISIONS, hf_gpt2, token_batch, vector_batch
from .traced import real_batches, real_model


def _checkpointing(setup: TrainingSetup | None) -> str:
    return setup.checkpointing.policy if setup is not None else "none"


@dataclass(frozen=True)
class Reference:
    """A family's real program. `build(config, setup)`: the torch module (setup None: the defaults), before the
    setup's dtype and LoRA; `batch(config, setup, generator)`: one micro-batch, (inputs, targets), drawn from
    `generator`. `whole`: a program that builds itself as the setup says, with its own batches (a traced model's:
    traced.py): `build(config, setup, seed)` is the model ready to train, `batch(config, setup, seed)` every
    micro-batch."""

    build: Callable
    batch: Callable
    whole: bool = False


# each family's real program, keyed by the family object (models/families/): a new family adds its line here (and
# the import of its program above)
PROGRAMS: dict[Family, Reference] = {
    families.traced.FAMILY: Reference(real_model, real_batches, whole=True),
    families.mixtral.FAMILY: Reference(lambda cfg, setup: hf_mixtral(cfg, _checkpointing(setup)), token_batch),
    families.hf_gpt2.FAMILY: Reference(lambda cfg, setup: hf_gpt2(cfg, _checkpointing(setup)), token_batch),
    families.nanogpt.FAMILY: Reference(lambda cfg, setup: GPT(cfg, setup), token_batch),
    families.mlp.FAMILY: Reference(lambda cfg, setup: MLP(cfg, setup), vector_batch),
}


def reference(cfg) -> Reference:
    """The real program of `cfg`'s family."""
    family = family_of(cfg)
    if family not in PROGRAMS:
        raise NotImplementedError(f"the {family.name} family has no real program to run (traces/reference/build.py "
                                  "PROGRAMS)")
    return PROGRAMS[family]


def build_model(cfg, setup: TrainingSetup | None = None, seed: int = 0) -> nn.Module:
    """The reference model for `cfg`, seeded, in training mode, in `setup`'s parameter dtype.

    Supported precisions: "fp32", pure "bf16" and "bf16-autocast" (fp32 parameters; run the forward
    and loss under `autocast_context(setup)`, as `traces.tracker.run_training_steps(autocast=...)` does).
    `setup.checkpointing.policy` runs the transformer blocks / MLP Linear(+activation) layers in the segments of
    `models.tape.checkpoint_segments`, the describer's regions ("full": each one under
    `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`). The program is `cfg`'s family's (`PROGRAMS`):
    the hf-gpt2 family's is HF's GPT2LMHeadModel (`hf_gpt2`).
    """
    program = reference(cfg)
    if program.whole:  # the traced program, for real (traced.py)
        return program.build(cfg, setup if setup is not None else TrainingSetup(), seed)
    if setup is not None and setup.precision.name not in REFERENCE_PRECISIONS:
        raise NotImplementedError(f"reference models run {', '.join(REFERENCE_PRECISIONS)} only, "
                                  f"not {setup.precision.name!r}")
    torch.manual_seed(seed)
    model = program.build(cfg, setup)
    if setup is not None and setup.precision.uniform and setup.precision.param == "bf16":
        model = model.to(torch.bfloat16)
    if setup is not None and setup.lora.r:  # peft LoRA / QLoRA (lora.py)
        model = apply_lora(model, cfg, setup)
    if setup is not None and setup.float8.recipe != "none":  # torchao Float8Linear, emulated (float8.py)
        model = apply_float8(model, setup)
    return model.train()


def freeze(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Set requires_grad=False on parameters whose name matches any fnmatch pattern; the trainable names."""
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError("frozen", f"pattern {pattern!r} matches no parameter (names look like {names[0]!r})")
    trainable = []
    for n, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(n, pat) for pat in patterns):
            p.requires_grad_(False)
        else:
            trainable.append(n)
    return trainable


IMPL_FLAGS = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "fused": {"fused": True}}


def make_optimizer(model: nn.Module, setup: TrainingSetup, lr: float = 1e-3):
    """`torch_optimizer` over the trainable parameters, after `setup.optimizer.frozen` patterns have frozen theirs
    (requires_grad=False)."""
    freeze(model, setup.optimizer.frozen)
    if setup.optimizer.in_backward:
        return InBackwardOptimizers(model, setup, lr)
    return torch_optimizer([p for p in model.parameters() if p.requires_grad], setup, lr)


class InBackwardOptimizers:
    """Optimizer-in-backward as torchtune 0.6.1 sets it up (torchtune/training/memory.py): one `optimizer_class`
    optimizer per trainable parameter (`optim_dict = {p: cls([p], ...)}`), and `register_optim_in_bwd_hooks`'s
    post-accumulate-grad hook on each parameter: `optim_dict[param].step(); optim_dict[param].zero_grad()`.
    torchtune's recipe then calls no step() or zero_grad() of its own: here they do nothing. `state` is every
    optimizer's states together and `register_step_post_hook` hooks every optimizer, for the tracker."""

    def __init__(self, model: nn.Module, setup: TrainingSetup, lr: float = 1e-3) -> None:
        cls, kwargs = optimizer_class(setup)
        self.optim_dict = {p: cls([p], lr=lr, **kwargs) for p in model.parameters() if p.requires_grad}

        def optim_step(param) -> None:  # torchtune 0.6.1 register_optim_in_bwd_hooks, as written there
            self.optim_dict[param].step()
            self.optim_dict[param].zero_grad()

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(optim_step)

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optim_dict.values() for p, s in opt.state.items()}

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optim_dict.values() for g in opt.param_groups]

    def register_step_post_hook(self, hook):
        handles = [opt.register_step_post_hook(hook) for opt in self.optim_dict.values()]
        return _Handles(handles)

    def step(self) -> None:
        """The hooks stepped every parameter in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The hooks zeroed every gradient in backward."""


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, handles) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def optimizer_class(setup: TrainingSetup) -> tuple[type[torch.optim.Optimizer], dict]:
    """The torch.optim class and its keyword arguments for `setup.optimizer.name` / `setup.optimizer.impl`, as the
    optimizer's entry in models/optimizers.py `OPTIMIZERS` names them (sgd: SGD(momentum=0); sgd-momentum:
    SGD(momentum=0.9); amsgrad: Adam(amsgrad=True); rmsprop: RMSprop; adagrad: Adagrad; ...); optimizer_impl
    "foreach" -> foreach=True, "for-loop" -> foreach=False, "fused" -> fused=True. An entry with a `reference`
    (models/lowbit.py: torchao.optim.AdamW8bit, ...) is that class, imported when asked for."""
    spec = OPTIMIZERS[setup.optimizer.name]
    if spec.reference is not None:  # the library's own class (torchao's, bitsandbytes'): no torch impl flags
        return spec.reference(), dict(spec.torch_kwargs)
    if spec.torch_class is None:
        raise NotImplementedError(
            f"no plain-torch reference for optimizer {setup.optimizer.name!r} (needs bitsandbytes)"
        )
    return getattr(torch.optim, spec.torch_class), {**dict(spec.torch_kwargs), **IMPL_FLAGS[setup.optimizer.impl]}


def torch_optimizer(params, setup: TrainingSetup, lr: float = 1e-3):
    """The `optimizer_class` optimizer over `params` (DTensors included); with `setup.offload.mode`
    it comes wrapped in a `StateOffload`."""
    cls, kwargs = optimizer_class(setup)
    if setup.offload.mode == "cpu":  # torchao's CPUOffloadOptimizer, on the CPU (torchao_offload.py)
        from .torchao_offload import TorchaoOffload

        return TorchaoOffload(params, setup, cls, kwargs, lr)
    optimizer = cls(params, lr=lr, **kwargs)
    return StateOffload(optimizer, setup) if setup.offload.mode != "none" else optimizer


class StateOffload:
    """An optimizer-state offload around a torch.optim optimizer, as models/optimizers.py describes it
    (prime-rl's CPUOffloadOptimizer with reused host buffers; chunked as Megatron's and prime-rl's).

    Between steps every tensor state but `step` lives in a host buffer (pinned where CUDA exists),
    allocated by the first offload and reused. `step()` copies each chunk in (`offload_prefetch` ahead),
    runs the wrapped optimizer's step over that chunk's parameters alone, and copies the chunk back,
    each device copy dropped as soon as it is copied. The first step creates the states: one whole
    `step()` ("whole") or chunk by chunk ("chunked"), each chunk offloaded before the next is created.
    On a CPU-only machine the "device" is the CPU too: the copies are real, separate allocations, and
    `host_buffers` tells the tracker which of them are the host's."""

    def __init__(self, optimizer: torch.optim.Optimizer, setup: TrainingSetup) -> None:
        self.optimizer = optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        chunks = offload_chunks([_local(p).numel() for p in params], setup.offload.mode,
                                setup.offload.chunk_params)
        self.chunks = [[params[i] for i in chunk] for chunk in chunks]
        self.prefetch = setup.offload.prefetch if setup.offload.mode == "chunked" else 0
        self.chunked_first = setup.offload.first_step == "chunked"
        self.host_buffers: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), key)
        self.started = False

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def register_step_post_hook(self, hook):
        """Runs after every step the wrapped optimizer takes (one per chunk)."""
        return self.optimizer.register_step_post_hook(hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        first, self.started = not self.started, True
        if first and not self.chunked_first:
            self.optimizer.step()
            for chunk in self.chunks:
                self._to_host(chunk)
            return
        issued = 0
        for k, chunk in enumerate(self.chunks):
            while not first and issued <= min(k + self.prefetch, len(self.chunks) - 1):
                self._to_device(self.chunks[issued])
                issued += 1
            self._step(chunk)
            self._to_host(chunk)

    def _step(self, chunk: list[torch.Tensor]) -> None:
        """The wrapped optimizer's step over `chunk`'s parameters alone."""
        keep = {id(p) for p in chunk}
        groups = self.optimizer.param_groups
        everything = [group["params"] for group in groups]
        for group in groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
        try:
            self.optimizer.step()
        finally:
            for group, params in zip(groups, everything):
                group["params"] = params

    def _offloaded_keys(self, p: torch.Tensor) -> list[str]:
        return [k for k, v in self.optimizer.state[p].items() if isinstance(v, torch.Tensor) and k != "step"]

    def _to_host(self, chunk: list[torch.Tensor]) -> None:
        for p in chunk:
            state = self.optimizer.state[p]
            for k in self._offloaded_keys(p):
                host = self.host_buffers.get((id(p), k))
                if host is None:
                    local = _local(state[k])
                    host = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                       pin_memory=torch.cuda.is_available())
                    self.host_buffers[(id(p), k)] = host
                host.copy_(_local(state[k]))
                state[k] = _with_local(state[k], host)  # the device copy goes with its last reference

    def _to_device(self, chunk: list[torch.Tensor]) -> None:
        for p in chunk:
            state = self.optimizer.state[p]
            for k in self._offloaded_keys(p):
                local = torch.empty_like(_local(state[k]), device=_local(p).device)
                state[k] = _with_local(state[k], local.copy_(_local(state[k]), non_blocking=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what holds the memory), else the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _with_local(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in `t`'s place: a DTensor of the same mesh and placements around it (as prime-rl's offload
    does), or `local` itself."""
    if not isinstance(t, DTensor):
        return local
    out = copy.copy(t)
    out._local_tensor = local
    return out


def make_batch(cfg, setup: TrainingSetup, seed: int = 0, n: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """`n` (default `setup.batch.grad_accum`) deterministic micro-batches of (inputs, targets), as `cfg`'s family's
    program takes them (`Reference.batch`): transformers' int64 token ids and next-token targets, (micro_batch,
    seq_len); an MLP's (micro_batch, d_in) inputs and (micro_batch, d_out) targets in the parameter dtype; a traced
    model's own.
    """
    program = reference(cfg)
    if program.whole:
        return program.batch(cfg, setup, seed)
    g = torch.Generator().manual_seed(seed)
    return [program.batch(cfg, setup, g) for _ in range(setup.batch.grad_accum if n is None else n)]
