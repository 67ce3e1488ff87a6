"""torchao's CPUOffloadOptimizer run for real on a CPU-only machine (`optimizer_offload cpu`), its code unchanged.

torchao 0.18.0 torchao/optim/cpu_offload.py asserts a CUDA or XPU device (`get_available_devices()[-1]`), makes its
host buffers with `pin_memory=True`, copies on a `torch.cuda.Stream` and calls `Tensor.record_stream`. None of that
exists without an accelerator, so `CpuShims` stands in for exactly these, seen by that module alone:
- `get_available_devices` answers `[..., "cuda"]`;
- the module's `torch` is a view of torch whose `cuda.Stream()` / `cuda.current_stream()` are `HostStream`s (work
  runs at once on the CPU: `wait_stream` and `synchronize` have nothing to wait for, `record_event()` gives an event
  whose `synchronize` returns) and `cuda.stream(s)` a null context; whose `empty_like(..., pin_memory=True)` makes
  a pageable tensor (no pinned allocator here: the bytes are the same, the pinning is not shown);
- `Tensor.record_stream(HostStream)` does nothing (any other stream goes to torch's own).
The rest is the library's: which parameters it keeps on the device (`minimal_size`), its host copies of the
parameters and gradients, the post-accumulate-grad hooks and their copies, `offload_gradients` dropping each
gradient, the host optimizers and their lazily made states, the copies back, `zero_grad`.

On the CPU the "device" and the host are one memory: `TorchaoOffload.host_buffers` names the library's host tensors
(`p_host`, `p_host.grad`, each host optimizer's states) for the tracker, which counts them as Pool.HOST.
"""

from __future__ import annotations

import contextlib
import types

import torch

from ...models.config import TrainingSetup


class _Event:
    def synchronize(self) -> None:
        pass


class HostStream:
    """A stream on the CPU: everything issued to it has run already."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


def _empty_like(t, *args, pin_memory: bool = False, **kwargs):
    return torch.empty_like(t, *args, **kwargs)


class _TorchView(types.ModuleType):
    """torch as the offload module sees it: its own `cuda` stand-in and `empty_like`, the rest torch's."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(Stream=HostStream, current_stream=lambda *a, **k: HostStream(),
                                          stream=lambda s: contextlib.nullcontext())
        self.empty_like = _empty_like

    def __getattr__(self, name):
        return getattr(torch, name)


_REAL_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream(self, stream):
    if isinstance(stream, HostStream):
        return None
    return _REAL_RECORD_STREAM(self, stream)


def install_cpu_shims():
    """Point torchao's offload module at the stand-ins (idempotent); returns the module."""
    from torchao.optim import cpu_offload

    if not isinstance(cpu_offload.torch, _TorchView):
        cpu_offload.torch = _TorchView()
        cpu_offload.get_available_devices = lambda: ["cpu", "cuda"]
        torch.Tensor.record_stream = _record_stream
    return cpu_offload


class TorchaoOffload:
    """torchao's CPUOffloadOptimizer over `params`, as a run's optimizer: the tracker's view of it (`state`: the
    on-device optimizer's states; `host_buffers`: the host tensors; `register_step_post_hook`)."""

    def __init__(self, params, setup: TrainingSetup, optimizer_class, kwargs: dict, lr: float = 1e-3) -> None:
        module = install_cpu_shims()
        self.optimizer = module.CPUOffloadOptimizer(list(params), optimizer_class,
                                                    offload_gradients=setup.offload.gradients, lr=lr, **kwargs)
        self._post_hooks = []

    @property
    def state(self):
        return self.optimizer.d_opt.state if self.optimizer.d_opt is not None else {}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def host_buffers(self) -> dict[tuple[int, str], torch.Tensor]:
        out = {}
        for p_device, p_host in self.optimizer.param_d2h_map.items():
            out[(id(p_device), "cpu_offload.p_host")] = p_host
            out[(id(p_device), "cpu_offload.p_host.grad")] = p_host.grad
            for k, v in self.optimizer.optim_dict[p_device].state[p_host].items():
                if isinstance(v, torch.Tensor):
                    out[(id(p_device), k)] = v
        return out

    def register_step_post_hook(self, hook):
        self._post_hooks.append(hook)
        return types.SimpleNamespace(remove=lambda: self._post_hooks.remove(hook))

    def step(self) -> None:
        self.optimizer.step()
        for hook in self._post_hooks:
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


__all__ = ["TorchaoOffload", "HostStream", "install_cpu_shims"]
