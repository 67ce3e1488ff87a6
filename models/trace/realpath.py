"""What makes a trace on fake tensors the program the real run runs.

Fake tensors have shapes but no values, and some code takes another path on them. Three things put the
recorder (record.py) back on the real path:
- `Shadows`: integer and boolean tensors (token ids, positions, masks) carry their real values through the
  trace, so a Python branch on them (`if (mask == 0).all():`, `.item()`) goes the way the real run goes;
- `real_code_paths`: transformers' "am I tracing?" test does not count fake tensors while recording (it would
  materialise masks and skip checks the real run makes);
- `cpu_fake_kernels`: a CPU kernel whose fake rule checks a GPU constraint instead (MoE `grouped_mm`) gets the
  CPU kernel's rule.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def _tensors(tree) -> list[torch.Tensor]:
    return [a for a in tree_flatten(tree)[0] if isinstance(a, torch.Tensor)]


SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                torch.ops.aten.equal.default}
SHADOW_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
SHADOW_LIMIT = 1 << 24  # elements: integer tensors up to this size carry their real values


class Shadows:
    """Real values for the integer and boolean tensors of a trace (token ids, positions, masks), so that a
    Python branch on them (`if (mask == 0).all():`, `.item()`) takes the branch the real run takes instead of
    failing on a fake tensor. The batch's tensors come with their values (`add`); an op whose tensor inputs all
    have values (or that has none, like `arange`) and whose outputs are small integer tensors is run for real
    on those values too. Float tensors never have values: their values are the weights', which a trace does
    not have."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary
        self.values = WeakIdKeyDictionary()

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        self.values[fake] = real

    def inputs(self, func, args, kwargs):
        """(real args, real kwargs) when every tensor argument has a value, else None."""
        leaves = _tensors((args, kwargs))
        if any(t not in self.values for t in leaves):
            return None
        swap = lambda a: self.values[a] if isinstance(a, torch.Tensor) else a  # noqa: E731
        from torch.utils._pytree import tree_map
        return tree_map(swap, args), tree_map(swap, kwargs or {})

    def run(self, func, real):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            return func(*real[0], **real[1])

    def follow(self, func, real, out) -> None:
        fakes = _tensors(out)
        if not fakes or any(t.dtype not in SHADOW_DTYPES or t.numel() > SHADOW_LIMIT for t in fakes):
            return
        try:
            values = _tensors(self.run(func, real))
        except Exception:  # an op that will not run on the real values: its outputs have none
            return
        if len(values) == len(fakes):
            for f, r in zip(fakes, values):
                self.values[f] = r


class cpu_fake_kernels:
    """Fake-tensor rules for the CPU kernels whose meta function checks a GPU's constraints instead:
    `aten._grouped_mm` (MoE experts) runs in fp32 on the CPU, but its meta function demands bf16
    (torch/_meta_registrations.py `_meta_grouped_mm_common`). The rule here gives the CPU kernel's output:
    shape from the operands, last dimension's stride padded to 16 bytes
    (aten/src/ATen/native/GroupedMMUtils.h `create_grouped_gemm_output_tensor`)."""

    def __enter__(self):
        from torch._subclasses import fake_impls

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
        import sys
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
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

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
