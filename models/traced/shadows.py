"""Real values for the tensors of a trace on fake tensors whose values are knowable (`Shadows`): integer and
boolean tensors (token ids, positions, masks), small constant fills, and while a model is built small float
tensors, so that a Python branch on them goes the way the real run goes; a branch decided by a random draw is
`RandomBranch`."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors among `tree`'s pytree leaves, in `tree_flatten`'s order (torch/utils/_pytree.py: a dict flattens
    to its values in insertion order, a tensor is a leaf). Called several times per op of a trace: plain tuples,
    lists and dicts (an op's arguments) are walked here, anything else (a namedtuple, a model output, a registered
    node) by `tree_flatten`. (Each `tree_flatten` call leaves a reference cycle behind, its recursive `helper`
    closure, torch 2.13: a trace under a paused collector piled up 100,000 such objects per 6 layers, then one
    full collection of half a second.)"""
    out: list[torch.Tensor] = []
    _walk(tree, out)
    return out


_LEAVES = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout,
                     torch.memory_format, torch.Size})  # leaves that are never tensors (and no pytree node)


def _walk(x, out: list) -> None:
    t = type(x)
    if t is tuple or t is list:
        for a in x:
            if type(a) in _LEAVES:
                continue
            if isinstance(a, torch.Tensor):
                out.append(a)
            else:
                _walk(a, out)
    elif t is dict:
        _walk(list(x.values()), out)
    elif isinstance(x, torch.Tensor):
        out.append(x)
    elif t not in _LEAVES:
        out.extend(a for a in tree_flatten(x)[0] if isinstance(a, torch.Tensor))


aten = torch.ops.aten
SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
SHADOW_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
SHADOW_LIMIT = 1 << 24  # elements: integer tensors up to this size carry their real values
# factory ops filling a new tensor with a constant: in the traced run, a float one made so has a value too, up to
# FILL_LIMIT elements (not a weight's: BART's decoder makes `torch.ones(batch, seq)` as its attention mask, which
# masking_utils.py then reads); while a model is built, weights are made so: there, floats keep `float_limit`
CONSTANT_FILLS = {aten.ones.default, aten.zeros.default, aten.full.default, aten.scalar_tensor.default}
FILL_LIMIT = 1 << 20
# elements: while a model is built, float tensors up to this size made from constants carry their values too
# (the drop-path rates `[x.item() for x in torch.linspace(0, drop_path_rate, depth)]`)
BUILD_FLOAT_LIMIT = 1 << 16
# ops whose outputs' values are not a function of their inputs' values: uninitialised memory (random draws are
# the ops torch tags `nondeterministic_seeded`)
UNINITIALISED = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                 aten.new_empty.default, aten.new_empty_strided.default, aten.empty_permuted.default,
                 aten.resize_.default}
# ops taking a list of indices, each of which may be a boolean mask (the kernel takes its nonzero positions)
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# CTC loss: its outputs' shape depends on the targets' lengths (LossCTC.cpp `ctc_loss_cpu_template`:
# neg_log_likelihood (batch,), log_alpha (batch, input frames, 2 * longest target + 1), both `at::empty`)
CTC_LOSS = {aten._ctc_loss.Tensor, aten._ctc_loss.default}
# draws whose values lie in [0, 1) (torch.rand, uniform on [0, 1)), and draws that read only their input's shape
UNIT_DRAWS = {aten.rand.default, aten.rand.generator, aten.rand_like.default}
SHAPE_DRAWS = {aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
               aten.randint_like.low_dtype}
# a comparison of values in [lo, hi] (closed: a draw rounded to bf16 may reach 1.0) with a number: the answer
# every value gives, or None
_COMPARE = {aten.lt.Scalar: lambda lo, hi, x: True if hi < x else False if lo >= x else None,
            aten.le.Scalar: lambda lo, hi, x: True if hi <= x else False if lo > x else None,
            aten.gt.Scalar: lambda lo, hi, x: True if lo > x else False if hi <= x else None,
            aten.ge.Scalar: lambda lo, hi, x: True if lo >= x else False if hi < x else None}


class RandomBranch(DataDependentOutputException):
    """A Python branch on a random draw (LayerDrop): which way the real run goes changes from step to step."""

    def __str__(self) -> str:
        return (f"a random draw decides a Python branch ({self.func}: e.g. LayerDrop, `if torch.rand([]) < "
                "layerdrop: skip the layer`); the real run runs or skips the work at random, so its memory "
                "changes from step to step and no single trace is it; set the rate to 0 (layerdrop=0.0) to "
                "trace the step in which everything runs")


class Shadows:
    """Real values for the tensors of a trace whose values are knowable, so that a Python branch on them
    (`if (mask == 0).all():`, `.item()`, `.tolist()`) takes the branch the real run takes instead of failing on
    a fake tensor:
    - integer and boolean tensors (token ids, positions, masks): the batch's come with their values (`add`);
      an op whose tensor inputs all have values (real tensors, `torch.tensor(data)`, have their own; factory
      ops like `arange` have none) and whose outputs are small integer tensors is run for real on those values;
    - while the model is built (`build_values`, `float_limit` > 0), small float tensors made so too: a model's
      `__init__` computing its drop-path rates `torch.linspace(0, rate, depth).tolist()` gets the real rates;
    - a comparison of a `torch.rand` draw (values in [0, 1)) with a number outside that range: one answer
      (`torch.rand([]) < 0.0` is False), whatever the draw.
    An op run on fake inputs that writes a tensor (in place) takes its value away, and its aliases'. Random
    draws (torch's `nondeterministic_seeded` ops) and uninitialised memory (`empty`) never have values; a
    Python branch on a value made only of random draws and constants is `RandomBranch`. Float tensors in the
    traced run itself have values only when a factory op fills them with a constant (`CONSTANT_FILLS`, small
    ones): the others' values are the weights', which a trace does not have."""

    def __init__(self, float_limit: int = 0) -> None:
        self.values = WeakIdKeyDictionary()
        self.draws = WeakIdKeyDictionary()  # tensors made only of random draws and known values -> (lo, hi) | None
        self.float_limit = float_limit

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        self.values[fake] = real

    def _value(self, t: torch.Tensor):
        return self.values.get(t) if isinstance(t, FakeTensor) else t

    def inputs(self, func, args, kwargs):
        """(real args, real kwargs) when every tensor argument has a value, else None."""
        leaves = tensors_in((args, kwargs))
        if any(isinstance(t, FakeTensor) and t not in self.values for t in leaves):
            return None
        swap = lambda a: self._value(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
        return tree_map(swap, args), tree_map(swap, kwargs or {})

    def run(self, func, real):
        with unset_fake_temporarily():
            return func(*real[0], **real[1])

    def read(self, func, args, kwargs, real):
        """A scalar read (`SCALAR_READS`): its real answer, or None when the fake tensor cannot give one (the
        fake kernel then raises); `RandomBranch` when the value is made only of random draws."""
        if real is not None:
            return self.run(func, real)
        if any(t in self.draws for t in tensors_in((args, kwargs)) if isinstance(t, FakeTensor)):
            raise RandomBranch(func)
        return None

    def known_shape(self, func, args, kwargs, real):
        """An op whose output shape depends on values (torch tags it `dynamic_output_shape`: nonzero,
        masked_select, unique, indexing with a boolean mask), where the values it depends on are known: None
        (run it as it is), ("out", fake outputs) made from the real run's outputs, or ("call", op, args,
        kwargs) to run instead: each known boolean index replaced by the integer indices the kernel computes
        from it (aten/src/ATen/native/IndexingUtils.h `expandTensors`: `mask.nonzero()` split by dimension),
        so that the fake kernel gives the real output shape; CTC loss's outputs made as its CPU kernel makes
        them from the known target lengths (`CTC_LOSS`). Wav2Vec2's CTC loss is one
        (modeling_wav2vec2.py `Wav2Vec2ForCTC.forward`: `labels.masked_select(labels_mask)` and
        `nn.functional.ctc_loss(..., input_lengths, target_lengths)`, the token ids and lengths known); so is
        its SpecAugment (`hidden_states[mask_time_indices] = ...`, a mask numpy draws). A shape that depends
        on float values stays unknown: the fake kernel refuses it (exit 2, the module named)."""
        fake = next((t for t in tensors_in((args, kwargs)) if isinstance(t, FakeTensor)), None)
        if fake is None:
            return None
        if real is not None and torch.Tag.dynamic_output_shape in func.tags:
            try:
                outs = self.run(func, real)
            except Exception:  # the real kernel refuses the values: so does the fake one, below
                return None
            flat, spec = tree_flatten(outs)
            fakes = [fake.fake_mode.from_tensor(r) if isinstance(r, torch.Tensor) else r for r in flat]
            for f, r in zip(fakes, flat):
                if isinstance(r, torch.Tensor) and (r.dtype in SHADOW_DTYPES and r.numel() <= SHADOW_LIMIT):
                    self.values[f] = r
            return "out", tree_unflatten(fakes, spec)
        if func in CTC_LOSS:  # the outputs' shape: the batch, the input frames, twice the longest target + 1
            lengths = [self._value(a) if isinstance(a, torch.Tensor) else a for a in args[2:4]]
            if any(v is None for v in lengths):
                return None
            with unset_fake_temporarily():
                longest = max((int(n) for n in (lengths[1].tolist() if isinstance(lengths[1], torch.Tensor)
                                                else lengths[1])), default=0)
            log_probs = args[0]
            batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
            return "out", (log_probs.new_empty((batch,)),
                           log_probs.new_empty((batch, log_probs.shape[0], 2 * longest + 1)))
        if func not in BOOL_INDEXED or len(args) < 2 or not isinstance(args[1], (list, tuple)):
            return None
        indices, changed = [], False
        for index in args[1]:
            value = self.values.get(index) if isinstance(index, FakeTensor) else None
            if value is not None and value.dtype in (torch.bool, torch.uint8):
                with unset_fake_temporarily():
                    positions = value.nonzero().unbind(1)
                indices += [fake.fake_mode.from_tensor(k) for k in positions]
                changed = True
            else:
                indices.append(index)
        return ("call", func, (args[0], indices) + tuple(args[2:]), kwargs) if changed else None

    def _eligible(self, func, fakes) -> bool:
        if not fakes or func in UNINITIALISED or torch.Tag.nondeterministic_seeded in func.tags:
            return False
        fill = func in CONSTANT_FILLS and not self.float_limit  # (the traced run, not a build)
        for t in fakes:
            limit = SHADOW_LIMIT if t.dtype in SHADOW_DTYPES else FILL_LIMIT if fill else \
                self.float_limit if t.is_floating_point() else 0
            if t.numel() > limit:
                return False
        return True

    def follow(self, func, args, kwargs, real, out) -> None:
        """After `func` ran on fake tensors: its outputs' values (`real`: its inputs' values, or None)."""
        fakes = tensors_in(out)
        if real is not None and self._eligible(func, fakes):
            try:
                values = tensors_in(self.run(func, real))
            except Exception:  # an op that will not run on the real values: its outputs have none
                values = ()
            if len(values) == len(fakes):
                for f, r in zip(fakes, values):
                    self.values[f] = r
                return
        self._forget(func, args, kwargs, fakes)
        if fakes:
            self._drawn(func, args, kwargs, fakes)

    def _forget(self, func, args, kwargs, fakes) -> None:
        """What the op wrote has no value any more, nor have the tensors that share its storage."""
        if not self.values:
            return
        written = [t for t in fakes if t in self.values]
        for k, name in _written_args(func):
            value = args[k] if k is not None and k < len(args) else (kwargs or {}).get(name)
            written += [t for t in tensors_in(value) if isinstance(t, FakeTensor) and t in self.values]
        for t in written:
            real = self.values.pop(t, None)
            if real is None:
                continue
            storage = real.untyped_storage().data_ptr()
            for other in [k for k, v in self.values.items() if v.untyped_storage().data_ptr() == storage]:
                self.values.pop(other, None)

    def _drawn(self, func, args, kwargs, fakes) -> None:
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if not seeded and not self.draws:  # no draw made yet: nothing to follow (the common case)
            return
        ins = [t for t in tensors_in((args, kwargs)) if isinstance(t, FakeTensor)]
        if seeded:
            if func in SHAPE_DRAWS or not ins:
                bounds = (0.0, 1.0) if func in UNIT_DRAWS else None
                for f in fakes:
                    self.draws[f] = bounds
            return
        if not ins or not all(t in self.draws or t in self.values for t in ins) or \
                not any(t in self.draws for t in ins):
            return
        decide = _COMPARE.get(func)
        bounds = self.draws.get(args[0]) if isinstance(args[0], FakeTensor) else None
        if decide is not None and bounds is not None and isinstance(args[1], (int, float)) and len(fakes) == 1:
            answer = decide(bounds[0], bounds[1], args[1])
            if answer is not None:  # every draw gives the same answer: a value
                with unset_fake_temporarily():
                    self.values[fakes[0]] = torch.full(fakes[0].shape, answer, dtype=torch.bool)
                return
        for f in fakes:
            self.draws[f] = None


_WRITES: dict = {}


def _written_args(func) -> tuple:
    """(position or None for keyword-only, name) of each argument `func` writes (its schema's `Tensor(a!)`)."""
    hit = _WRITES.get(func)
    if hit is None:
        hit = _WRITES[func] = tuple((None if a.kwarg_only else k, a.name) for k, a in enumerate(func._schema.arguments)
                                    if a.alias_info is not None and a.alias_info.is_write)
    return hit
