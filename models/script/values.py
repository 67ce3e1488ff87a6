"""Values for a script run on fake tensors: what it reads keeps it on its training path, and the report says so.

Fake tensors have no values, and scripts read values: `loss.item()` to log, `if torch.isnan(loss)`, a metric
into numpy, `labels.ne(-100).sum()` to count tokens. A read is answered, in this order:
- by the value the tensor really has (models/traced/shadows.py `Shadows`): integer and boolean tensors made from
  the script's data (token ids, labels, masks) and from its random integer draws, which run for real here
  (`torch.randint`, `torch.randperm`: a sampler's order, a seed drawn from torch's generator) on the same CPU
  generator the real run uses;
- by the finite assumption: `isnan` / `isinf` of a tensor with no value are all False, `isfinite` all True (their
  values follow through `any`, `logical_not`, `|`...): a training run whose loss is finite; and by boolean
  algebra where one known side decides (`known_true | x`); a token a generation draws is never a stop token
  (`isin(ids, eos_ids)` of drawn ids is all False): generation runs to its maximum length, the most memory;
- else by a stand-in: 1.0 for a floating point read, 1 for an integer, False for a boolean; `.numpy()` and
  `.tolist()` of a tensor with no value give that stand-in in every element.
Each stand-in read is counted by where the script made it (file:line of the first frame outside torch and
peakledger), for the report.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from ..traced.realpath import (
    CONSTANT_FILLS,
    FILL_LIMIT,
    SHADOW_DTYPES,
    SHADOW_LIMIT,
    UNINITIALISED,
    RandomBranch,
    Shadows,
)

aten = torch.ops.aten
# the finite assumption (isnan of a loss: False), and generation runs to its maximum length: a drawn token is never
# one of the stop tokens (`isin(completion_ids, eos_ids)`: False)
ASSUMED_FALSE = {aten.isnan.default, aten.isinf.default, aten.isposinf.default, aten.isneginf.default,
                 aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar}
ASSUMED_TRUE = {aten.isfinite.default}
# boolean ops one known side decides: op -> the value that side must have everywhere (True for or, False for and)
ABSORBING = {aten.bitwise_or.Tensor: True, aten.logical_or.default: True, aten.bitwise_or_.Tensor: True,
             aten.bitwise_and.Tensor: False, aten.logical_and.default: False, aten.bitwise_and_.Tensor: False,
             aten.mul.Tensor: False}
# random integer draws run for real (their outputs get values): a sampler's permutation, a seed, token ids
REAL_DRAWS = {aten.randperm.default, aten.randperm.generator, aten.randint.default, aten.randint.generator,
              aten.randint.low, aten.randint.low_generator, aten.random_.default, getattr(aten.random_, "from"),
              aten.random_.to}
_TREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HERE = tuple(os.path.join(_TREE, layer) + os.sep for layer in ("simulator", "models", "traces", "analysis",
                                                                "peakledger"))  # peakledger's own code
_TORCH = os.path.dirname(torch.__file__)


def standin(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return 1.0
    return False if dtype is torch.bool else 1


def where_in_script() -> str:
    """file:line of the innermost frame that is neither torch's nor peakledger's (the script or its library)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH) or name.startswith(_HERE) or name.startswith("<")):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


SMALL_FLOATS = 16  # elements: a float tensor this small computed from values has one (a step count, a loss scale)


class ScriptShadows(Shadows):
    """`Shadows` for a whole script: besides integer tensors and constant fills, small float tensors computed from
    values keep theirs (an optimizer's `step` tensor counts up: `step_t += 1` then `step_t.item()` is the real
    step, as in the real run)."""

    def _eligible(self, func, fakes) -> bool:
        if not fakes or func in UNINITIALISED or torch.Tag.nondeterministic_seeded in func.tags:
            return False
        for t in fakes:
            limit = SHADOW_LIMIT if t.dtype in SHADOW_DTYPES else FILL_LIMIT if func in CONSTANT_FILLS else \
                SMALL_FLOATS
            if t.numel() > limit:
                return False
        return True


class Values:
    """The values side of a fake run: `shadows` (real values), the finite assumption, real integer draws, and
    the stand-ins given (`given`: (where, what) -> count)."""

    def __init__(self) -> None:
        self.shadows = ScriptShadows()
        self.given: Counter = Counter()

    def read(self, func, args, kwargs, real):
        """A scalar read: the real value where known, else a stand-in (counted)."""
        try:
            answer = self.shadows.read(func, args, kwargs, real)
        except RandomBranch:  # a branch on a random draw: the stand-in, counted like the others
            answer = None
        if answer is not None:
            return answer
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        value = standin(t.dtype) if t is not None and func is aten._local_scalar_dense.default else False
        self.given[(where_in_script(), _word(value))] += 1
        return value

    def draw(self, func, args, kwargs, fake_out):
        """A random integer draw run for real on the CPU generator: its value follows the fake output."""
        outs = [t for t in (fake_out if isinstance(fake_out, (tuple, list)) else (fake_out,))
                if isinstance(t, torch.Tensor)]
        if not outs or any(t.dtype.is_floating_point or t.numel() > SHADOW_LIMIT for t in outs):
            return
        with unset_fake_temporarily():
            real_args = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, FakeTensor) else a for a in args]
            kw = {k: (v if not isinstance(v, torch.Tensor) or not isinstance(v, FakeTensor)
                      else torch.zeros(v.shape, dtype=v.dtype)) for k, v in (kwargs or {}).items()}
            if "device" in kw:
                kw["device"] = "cpu"
            try:
                value = func(*real_args, **kw)
            except Exception:  # a draw the real kernel will not make here: no value
                return
        if isinstance(value, torch.Tensor):
            self.shadows.add(outs[0], value)
            if func._schema.name.endswith("_") and args and isinstance(args[0], FakeTensor):
                self.shadows.add(args[0], value)

    def assume(self, func, args, out) -> None:
        """The finite assumption: `isnan(x)` of an `x` with no value is all False (`isfinite` all True); and what
        boolean algebra decides without the unknown side: `known_true | x` is all True, `known_false & x` all False
        (generation's stopping test: at the maximum length `is_done | eos_done` is all True whatever tokens were
        drawn)."""
        if not isinstance(out, FakeTensor) or out in self.shadows.values or out.numel() > SHADOW_LIMIT:
            return
        answer = None
        if func in ASSUMED_FALSE or func in ASSUMED_TRUE:
            answer = func in ASSUMED_TRUE
        elif func in ABSORBING and (out.dtype is torch.bool or not (out.is_floating_point() or out.is_complex())):
            wanted = ABSORBING[func]  # or: a known side all True (boolean outputs); and / mul: a known side all 0
            with unset_fake_temporarily():
                for a in args:
                    value = self.shadows.values.get(a) if isinstance(a, FakeTensor) else None
                    if value is None or not value.numel():
                        continue
                    if (wanted and out.dtype is torch.bool and value.dtype is torch.bool and bool(value.all())) or \
                            (not wanted and not bool(value.any())):
                        answer = wanted
                        break
        if answer is not None:
            with unset_fake_temporarily():
                self.shadows.add(out, torch.full(tuple(out.shape), answer, dtype=out.dtype))

    def array(self, t: torch.Tensor):
        """`t.numpy()` / `t.tolist()` of a fake tensor: its real value, else the stand-in in every element."""
        real = self.shadows.values.get(t)
        if real is not None:
            return real
        self.given[(where_in_script(), f"{_word(standin(t.dtype))} x {t.numel()}")] += 1
        with _disable_current_modes():  # made outside the recording: the real read allocates no torch storage
            return torch.full(tuple(t.shape), standin(t.dtype), dtype=t.dtype)

    def lines(self) -> list[str]:
        """The stand-ins given, for the report: where, what, how many times."""
        return [f"{where}: {what} ({n}x)" for (where, what), n in sorted(self.given.items())]


def _word(value) -> str:
    return repr(value)


def _keep(t: torch.Tensor) -> None:
    """A numpy array's finalizer, holding the fake tensor it was read from until the array goes."""


class numpy_reads:
    """`Tensor.numpy`, `Tensor.tolist` and `Tensor.__array__` of fake tensors answered by `values.array` while
    active (an eval loop's `nested_numpify`, a metric's `.tolist()`)."""

    def __init__(self, values: Values) -> None:
        self.values = values

    def __enter__(self) -> "numpy_reads":
        names = ("numpy", "tolist", "__array__")
        self.own = {n: torch.Tensor.__dict__.get(n) for n in names}  # (numpy and tolist are TensorBase's)
        self.saved = {n: getattr(torch.Tensor, n) for n in names}
        values, saved = self.values, self.saved

        def reader(name):
            original = saved[name]

            def read(t, *args, **kwargs):
                if isinstance(t, FakeTensor):
                    real = values.array(t)
                    with _disable_current_modes():  # (numpy() detaches: not the script's op)
                        out = getattr(real, name)(*args, **kwargs)
                    if name != "tolist":  # a CPU tensor's numpy view keeps its storage alive while the array lives
                        weakref.finalize(out, _keep, t)
                    return out
                return original(t, *args, **kwargs)
            return read

        for name in self.saved:
            setattr(torch.Tensor, name, reader(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, f in self.own.items():
            if f is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, f)
