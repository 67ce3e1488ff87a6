"""FSDP2's buffers on a tracked rank, labelled as FSDP2 allocates them: the tracker (tracker/) enters `FSDPLabels`
when the model has `fully_shard` units, and it wraps each unit's all-gather and reduce-scatter comms with delegating
ones that name what they allocate (torch/distributed/fsdp/_fully_shard/_fsdp_api.py `AllGather`, `ReduceScatter`)."""

from __future__ import annotations

import contextlib

import torch

from ..simulator.events import Category


class FSDPLabels:
    """What FSDP2 (`fully_shard`) allocates on a rank, labelled as it is allocated.

    fully_shard replaces each parameter by a DTensor whose local shard is a view of a storage padded
    to ceil(dim0 / N) rows (PARAMETER, by parameter name, through the DTensor's `_local_tensor`). Around
    each unit's compute FSDP2 allocates, through the unit's comm objects' `allocate`:
    - `<unit>.all_gather_output` (ALL_GATHER_BUFFER): one flat buffer of every padded parameter of
      the unit, N x the unit's padded shard; this rank's all-gather input is a view of its own slice
      (the shards are copied in), so it has no allocation of its own unless a dtype cast needs one.
    - `<unit>.reduce_scatter_input` (REDUCE_SCATTER_BUCKET): the padded unsharded grads, copied in.
    - `<unit>.reduce_scatter_output` (REDUCE_SCATTER_BUCKET, then GRADIENT): this rank's reduced slice;
      its views become the unit's sharded `.grad`s, so the tracker's scan relabels it GRADIENT and it
      keeps this name.
    - `<unit>.<collective>.backend_copy` (the collective's category): what the process group itself
      allocates inside the call and the tracker sees (gloo's reduce-scatter clones its whole input).
    The comms are wrapped with delegating ones (`FSDPModule.set_custom_all_gather` /
    `set_custom_reduce_scatter`): the same `allocate` and the same collective, plus a label; the
    defaults are put back on exit.
    Each parameter's unsharded storage (its own all-gather output, which the copy-out fills and the
    compute reads) is labelled PARAMETER `<param>.unsharded` when the unit's pre-forward has gathered
    it; FSDP2 frees and re-allocates it with `UntypedStorage.resize_`, and every re-allocation inherits
    the label (see `_StorageResizeWatch`). It is a PARAMETER rather than an ALL_GATHER_BUFFER: it is
    the tensor registered on the module and saved by autograd, one per parameter, live for the
    unsharded window only. Its gradient, from the backward op that makes it until the unit's
    post-backward copies it into the reduce-scatter input, is GRADIENT `<param>.unsharded.grad`.
    """

    def __init__(self, tracker, model: torch.nn.Module) -> None:  # tracker/ `AllocationTracker`, which enters it
        from torch.distributed.fsdp import FSDPModule

        self.tracker = tracker
        self.units = {module: name or "model" for name, module in model.named_modules()
                      if isinstance(module, FSDPModule)}
        self._originals: list[tuple] = []
        self._grad_hooks: dict[int, object] = {}  # id(unsharded parameter) -> hook handle

    @staticmethod
    def applies_to(model: torch.nn.Module) -> bool:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            return False
        return any(isinstance(m, FSDPModule) for m in model.modules())

    @staticmethod
    def _groups(unit) -> list:
        return list(unit._get_fsdp_state()._fsdp_param_groups)

    def __enter__(self) -> "FSDPLabels":
        for unit, name in self.units.items():
            groups = self._groups(unit)
            if not groups:
                continue
            group = groups[0]
            self._originals.append((unit, group._all_gather_comm, group._reduce_scatter_comm))
            label, backend = self._labeller(name), self._backend_copies(name)
            unit.set_custom_all_gather(_labelled_all_gather(group._all_gather_comm, label, backend))
            unit.set_custom_reduce_scatter(_labelled_reduce_scatter(group._reduce_scatter_comm, label, backend))
        return self

    def __exit__(self, *exc) -> None:
        for unit, all_gather, reduce_scatter in self._originals:
            unit.set_custom_all_gather(all_gather)
            unit.set_custom_reduce_scatter(reduce_scatter)
        self._originals.clear()
        for handle in self._grad_hooks.values():
            handle.remove()
        self._grad_hooks.clear()

    def _labeller(self, unit_name: str):
        def label(t: torch.Tensor, category: Category, what: str) -> None:
            self.tracker.mark(t, category, name=f"{unit_name}.{what}")
        return label

    def _backend_copies(self, unit_name: str):
        """A context for one collective call: whatever it allocates that the tracker sees is the process
        group's own copy (gloo's reduce-scatter all-reduces a clone of the input, then copies this rank's
        chunk out), labelled `<unit>.<collective>.backend_copy` with the collective's category."""
        @contextlib.contextmanager
        def watch(category: Category, collective: str):
            first = len(self.tracker.records) + 1
            try:
                yield
            finally:
                for rid in range(first, len(self.tracker.records) + 1):
                    self.tracker.records[rid].label(category, f"{unit_name}.{collective}.backend_copy")
        return watch

    def label_unsharded(self, module: torch.nn.Module) -> None:
        """Label the unsharded storages of `module`'s parameters (call right after its pre-forward), and
        make each unsharded parameter label its `.grad` when autograd has accumulated it."""
        if module not in self.units:
            return
        for group in self._groups(module):
            for fsdp_param in group.fsdp_params:
                name = self.tracker.param_names.get(id(fsdp_param.sharded_param), fsdp_param._param_fqn)
                for t in fsdp_param.all_gather_outputs:
                    if t.untyped_storage().nbytes():
                        self.tracker.mark(t, Category.PARAMETER, name=f"{name}.unsharded")
                self._hook_unsharded_grad(fsdp_param, name)

    def _hook_unsharded_grad(self, fsdp_param, name: str) -> None:
        """The unsharded gradient lives from the backward op that makes it until the unit's post-backward
        has copied it into the reduce-scatter input: GRADIENT `<param>.unsharded.grad`."""
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is None or id(unsharded) in self._grad_hooks or not unsharded.requires_grad:
            return

        def label_grad(param: torch.Tensor) -> None:
            if param.grad is not None:
                self.tracker.mark(param.grad, Category.GRADIENT, name=f"{name}.unsharded.grad")

        self._grad_hooks[id(unsharded)] = unsharded.register_post_accumulate_grad_hook(label_grad)


def _labelled_all_gather(inner, label, backend_copies):
    """An AllGather comm that allocates and communicates through `inner` and labels its output buffer."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class LabelledAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            t = inner.allocate(size, dtype=dtype, device=device)
            label(t, Category.ALL_GATHER_BUFFER, "all_gather_output")
            return t

        def __call__(self, *args, **kwargs):
            with backend_copies(Category.ALL_GATHER_BUFFER, "all_gather"):
                return inner(*args, **kwargs)

    return LabelledAllGather()


def _labelled_reduce_scatter(inner, label, backend_copies):
    """A ReduceScatter comm through `inner` that labels its buffers: FSDP2's `foreach_reduce` allocates
    the input, then the output, once per reduce-scatter."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class LabelledReduceScatter(ReduceScatter):
        def __init__(self) -> None:
            self.calls = 0

        def allocate(self, size, *, dtype, device):
            t = inner.allocate(size, dtype=dtype, device=device)
            what = ("reduce_scatter_input", "reduce_scatter_output")[self.calls % 2]
            self.calls += 1
            label(t, Category.REDUCE_SCATTER_BUCKET, what)
            return t

        def __call__(self, *args, **kwargs):
            with backend_copies(Category.REDUCE_SCATTER_BUCKET, "reduce_scatter"):
                return inner(*args, **kwargs)

    return LabelledReduceScatter()
