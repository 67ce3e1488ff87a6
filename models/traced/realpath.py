"""What makes a trace on fake tensors the program the real run runs.

Fake tensors have shapes but no values, and some code takes another path on them. These put the recorder
(record.py) back on the real path:
- `Shadows` (shadows.py): integer and boolean tensors (token ids, positions, masks) carry their real values through the
  trace, so a Python branch on them (`if (mask == 0).all():`, `.item()`) goes the way the real run goes; a
  comparison of a `torch.rand` draw that every draw answers alike (`torch.rand([]) < 0.0`) has its answer; a
  branch on a random draw otherwise is `RandomBranch` (the real run's path changes from step to step);
- `build_values`: while the model is built, small float tensors computed from the config carry their values
  too (drop-path rates: `torch.linspace(0, drop_path_rate, depth).tolist()` in ConvNext, Swinv2, PVT, ...);
- `real_code_paths`: transformers' "am I tracing?" test does not count fake tensors while recording (it would
  materialise masks and skip checks the real run makes);
- `fresh_caches`: tensors a forward memoises (BEiT's relative position index) are computed in the trace, as in
  a process's first step, and no fake one is left for a later real run;
- `cpu_fake_kernels`: a CPU kernel whose fake rule checks a GPU constraint instead (MoE `grouped_mm`) gets
  the CPU kernel's rule (kernel_outputs.py gives outputs the layout and storage size the kernels give them);
- `view_replays` (inplace_views.py): a view written in place (an in-place ReLU on F.linear's output) gets the
  backward the real autograd engine builds for it (`AsStridedBackward0`), not the view replay fake tensors get.
"""

from __future__ import annotations

import sys

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.utils._python_dispatch import TorchDispatchMode

from .inplace_views import INPLACE_KEY, view_replays
from .shadows import (
    BUILD_FLOAT_LIMIT,
    CONSTANT_FILLS,
    FILL_LIMIT,
    SCALAR_READS,
    SHADOW_DTYPES,
    SHADOW_LIMIT,
    UNINITIALISED,
    RandomBranch,
    Shadows,
    tensors_in,
)

__all__ = ["fake_mode_active", "build_values", "cpu_fake_kernels", "real_code_paths", "fresh_caches", "lru_caches",
           # shadows.py's and inplace_views.py's, read from here too
           "tensors_in", "SCALAR_READS", "SHADOW_DTYPES", "SHADOW_LIMIT", "CONSTANT_FILLS", "FILL_LIMIT",
           "BUILD_FLOAT_LIMIT", "UNINITIALISED", "RandomBranch", "Shadows", "INPLACE_KEY", "view_replays"]


def fake_mode_active() -> bool:
    """A FakeTensorMode is on the dispatch stack (a trace runs; not a real build or run)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class build_values(TorchDispatchMode):
    """While a model is built on fake tensors (its `__init__`, a factory): `Shadows` with small float tensors
    too, so that values computed from the config (drop-path rates from `torch.linspace`, read by `.item()` /
    `.tolist()`: transformers' ConvNext, Swinv2, PVT, FocalNet, Hiera, ...; timm's `dpr`) are the real ones.
    Without a fake mode active (the real build) it does nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.shadows = Shadows(float_limit=BUILD_FLOAT_LIMIT)
        self.active = False

    def __enter__(self):
        self.active = fake_mode_active()
        return super().__enter__() if self.active else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self.active else False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "prim":
            return func(*args, **(kwargs or {}))
        real = self.shadows.inputs(func, args, kwargs)
        if func in SCALAR_READS:
            answer = self.shadows.read(func, args, kwargs, real)
            if answer is not None:
                return answer
        out = func(*args, **(kwargs or {}))
        self.shadows.follow(func, args, kwargs, real, out)
        return out


class cpu_fake_kernels:
    """Fake-tensor rules for the CPU kernels whose meta function checks a GPU's constraints instead:
    `aten._grouped_mm` (MoE experts) runs in fp32 on the CPU, but its meta function demands bf16
    (torch/_meta_registrations.py `_meta_grouped_mm_common`). The rule here gives the CPU kernel's output:
    shape from the operands, last dimension's stride padded to 16 bytes
    (aten/src/ATen/native/GroupedMMUtils.h `create_grouped_gemm_output_tensor`)."""

    def __enter__(self):
        self.table = fake_impls.op_implementations_dict
        self.op = torch.ops.aten._grouped_mm.default
        self.previous = self.table.get(self.op)
        self.table[self.op] = _fake_grouped_mm
        return self

    def __exit__(self, *exc):
        if self.previous is None:
            self.table.pop(self.op, None)
        else:
            self.table[self.op] = self.previous
        return False


class real_code_paths:
    """transformers takes a different code path on fake tensors (`utils/import_utils.py` `is_tracing` counts a
    FakeTensor as tracing: masks are materialised, packed-sequence checks skipped). While recording, a fake
    tensor does not count, so the traced program is the real run's; the branches it takes on integer values
    are answered by `Shadows`."""

    def __enter__(self):
        self.module = sys.modules.get("transformers.utils.import_utils")
        if self.module is not None:
            self.previous = self.module.is_fake_tensor
            self.module.is_fake_tensor = lambda x: False
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.is_fake_tensor = self.previous
        return False


def _fake_grouped_mm(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif a2:
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif b2:
        shape = (mat_a.shape[1], mat_b.shape[-1])
    else:
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    dtype = out_dtype or mat_a.dtype
    align = max(16 // torch.empty((), dtype=dtype, device="meta").element_size(), 1)
    last = -(-shape[-1] // align) * align
    strides = [1] * len(shape)
    strides[-2] = last
    if len(shape) == 3:
        strides[0] = shape[1] * last
    with in_kernel_invocation_manager(fake_mode):
        out = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, out, mat_a.device)


class fresh_caches:
    """Tensors a model's forward memoises across calls, computed anew by the trace and forgotten after it.
    transformers caches some tensors its forward builds from sizes alone (`pytorch_utils.py`
    `compile_compatible_method_lru_cache`, an `lru_cache` keyed by the sizes: BEiT's and Data2VecVision's
    `generate_relative_position_index`, modeling_beit.py `BeitRelativePositionBias`): a process computes
    them in its first forward and keeps them. Cleared before the recording, the trace is of that first
    forward, whatever ran before in this process (the cached tensor then outlives the step, and `convert`
    keeps it for the run, like a buffer); cleared after it, no later real run is served the trace's fake
    tensors (a real run indexing with a cached fake tensor makes fake outputs the tracker never sees). The
    caches are found in the modules that define the model's module classes (`lru_caches`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.caches = lru_caches(model)

    def __enter__(self):
        for c in self.caches:
            c.cache_clear()
        return self

    def __exit__(self, *exc):
        for c in self.caches:
            c.cache_clear()
        return False


def lru_caches(model: torch.nn.Module) -> list:
    """The `functools.lru_cache` wrappers of the Python modules defining `model`'s module classes: module-level
    functions, and functions, static and class methods of classes defined there, directly or inside a
    decorator's closure (transformers' `compile_compatible_method_lru_cache` wraps its `lru_cache`)."""
    found: dict[int, object] = {}

    def visit(obj, depth: int = 0) -> None:
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if hasattr(obj, "cache_clear") and hasattr(obj, "cache_info"):
            found[id(obj)] = obj
            return
        if depth < 2 and callable(obj):
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass

    names = {type(m).__module__ for m in model.modules()}
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                for attr in list(vars(value).values()):
                    visit(attr)
            elif getattr(value, "__module__", None) == name:
                visit(value)
    return list(found.values())
