"""Where autograd takes another branch on real tensors than on the fake ones a recording runs on.

torch counts a FakeTensor "subclass-like" (c10 isTensorSubclassLike), and every tensor too while a dispatch
mode runs (`dispatch_mode_enabled()`), so a fake recording takes the branches autograd keeps for subclasses:
out of place, a new tensor where the real run writes into one it holds. The CPU program is measured under the
tracker's dispatch mode and takes those branches too; the GPU program runs none, so the recording of the CUDA
program (cuda_program.py, `real_tensor_branches`) takes the real ones, decided here from what the recorder
(recorder.py) knows of each storage:
- `formula_branch`: backward formulas that make zeros and write the gradient into them (FunctionsManual.cpp
  index_backward: `index_put_` vs `index_put`; gather_backward: `scatter_add_` vs `scatter_add`;
  value_selecting_reduction_backward, max / min / topk / sort along a dim: `scatter_` vs `scatter`);
- `buffer_branch`: autograd's input buffer summing a second gradient into the first one a node received
  (torch/csrc/autograd/input_buffer.cpp `accumulate`): `old_var.add_(var)` when `can_accumulate_inplace(old_var)`
  (a dense, non-overlapping tensor whose storage only it uses, held only by the buffer), else `old_var + var`.
  The fake tensors show the storage's use count, not the tensor's: a gradient the buffer shares with another
  holder is taken as held by the buffer alone.
"""

from __future__ import annotations

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

aten = torch.ops.aten

SUBCLASS_OUT_OF_PLACE = {aten.index_put.default: aten.index_put_.default,
                         aten.scatter_add.default: aten.scatter_add_.default,
                         aten.scatter.src: aten.scatter_.src}


def formula_branch(func, args, made_here) -> object:
    """The in-place op a backward formula runs on real tensors where the fake run takes its out-of-place branch
    (SUBCLASS_OUT_OF_PLACE): when `func`'s first argument is a tensor this node made (`made_here(tensor)`, the
    formula's zeros) and, for index_put, it accumulates; else `func`."""
    inplace = SUBCLASS_OUT_OF_PLACE.get(func)
    if inplace is None or not args or not isinstance(args[0], torch.Tensor) or not made_here(args[0]):
        return func
    if func is aten.index_put.default and not (len(args) > 3 and args[3]):
        return func
    return inplace


def _only_user(t: torch.Tensor) -> bool:
    """No other tensor shares `t`'s storage: its use count is 2, `t`'s reference and the one taken to read it."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) == 2


def buffer_branch(func, args, kwargs, waiting, fresh) -> object:
    """`aten.add_` where `func` is the input buffer's `old_var + var` and the real run adds in place (module
    docstring), else `func`. An add is the buffer's when its first argument is a gradient waiting in a buffer
    (`waiting(t)`: made in backward by a node that ran before; it may be one the running node was also given, a
    gradient passed to two nodes, which the engine has let go of by the time it sums) and its second is this
    node's output (`fresh(t)`: made by it, or one of its inputs passed through)."""
    if func is not aten.add.Tensor or kwargs or len(args) != 2:
        return func
    old, new = args
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape \
            or old.dtype != new.dtype or not waiting(old) or not fresh(new):
        return func
    if not is_non_overlapping_and_dense_or_false(old) or not _only_user(old):
        return func
    return aten.add_.Tensor


__all__ = ["SUBCLASS_OUT_OF_PLACE", "buffer_branch", "formula_branch"]
