"""What makes a trace on fake tensors the program the real run runs.

Fake tensors have shapes but no values, and some code takes another path on them. These put the recorder
(record.py) back on the real path:
- `Shadows`: integer and boolean tensors (token ids, positions, masks) carry their real values through the
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
- `view_replays`: a view written in place (an in-place ReLU on F.linear's output) gets the backward the real
  autograd engine builds for it (`AsStridedBackward0`), not the view replay fake tensors get.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    in_kernel_invocation_manager,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary


def tensors_in(tree) -> list[torch.Tensor]:
    return [a for a in tree_flatten(tree)[0] if isinstance(a, torch.Tensor)]


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


INPLACE_KEY = "peakledger_inplace_op"  # a CopySlices node's metadata: the index of the in-place op it wraps


class view_replays:
    """The backward of a view written in place, as the real autograd engine builds it. After an in-place op
    on a view whose base requires grad, autograd gives the base a `CopySlices` node and regenerates the view's
    grad_fn. For a real tensor that node is one `AsStridedBackward0` (torch/csrc/autograd/variable.cpp
    `VariableHooks::grad_fn`), whose backward allocates the base's whole extent and scatters the gradient in
    (FunctionsManual.cpp `as_strided_backward`: `grad.new_zeros(base_size)`); a fake tensor dispatches to
    Python, so autograd replays the view ops instead (torchgen gen_inplace_or_view_type.py records a
    `view_func` when `is_python_dispatch()`), and a `ViewBackward0` allocates nothing. Swinv2's
    `continuous_position_bias_mlp` (modeling_swinv2.py: `nn.ReLU(inplace=True)` on the view F.linear returns)
    is one: the real backward holds one more gradient of the MLP's hidden size per attention block. The node
    the CopySlices wraps (the in-place ReLU's) saves what no `_saved_*` attribute shows; the recorder counts
    those saves, made between the in-place op and `resolve`, as the CopySlices' (record.py `INPLACE_KEY`), so
    the ReLU's result lives until the CopySlices has run, as in the real run.

    `note` sees each forward op (an in-place write on a view that requires grad is remembered), `resolve`
    (at the recorder's next op) finds the replayed chain of view nodes down to the `CopySlices` and hooks it:
    when the chain's gradient for the base is still a view of the gradient it received (no kernel of the chain
    allocated; a `SliceBackward0` allocates the base's extent as the real node does), its last node returns
    what `as_strided_backward` returns instead: a zeroed buffer of the base's extent with the gradient copied
    in. Not covered (they keep the fake program's backward): a view made before an in-place write to its base,
    and views whose memory overlaps (as_strided_backward's index_add path)."""

    def __init__(self) -> None:
        self.weakref = weakref
        self.pending: list = []

    def note(self, func, args, op: int) -> None:
        schema = func._schema
        if not args or not schema.arguments or schema.arguments[0].alias_info is None \
                or not schema.arguments[0].alias_info.is_write:
            return
        t = args[0]
        if isinstance(t, FakeTensor) and t._is_view() and torch.is_grad_enabled():
            base = t._base
            geometry = ((tuple(base.shape), tuple(base.stride()), base.storage_offset()),
                        (tuple(t.shape), tuple(t.stride()), t.storage_offset()))
            self.pending.append((self.weakref.ref(t), geometry, op))

    def resolve(self, now: int) -> None:
        """`now`: the forward ops recorded so far; the saves made since the in-place op (autograd saves its
        result after the view and detach ops it dispatches to build the CopySlices) are the CopySlices'."""
        pending, self.pending = self.pending, []
        for ref, geometry, op in pending:
            t = ref()
            top = t.grad_fn if t is not None and t.requires_grad else None
            chain, node = [], top
            while node is not None and len(chain) < 16 and node.name() != "torch::autograd::CopySlices":
                chain.append(node)
                node = node.next_functions[0][0] if node.next_functions else None
            if node is None or not chain or "peakledger_replay" in chain[-1].metadata:
                continue
            node.metadata.setdefault(INPLACE_KEY, (op, now))  # the CopySlices: the saves of the op it wraps
            chain[-1].metadata["peakledger_replay"] = True
            self._hook(chain[0], chain[-1], *geometry)

    @staticmethod
    def _hook(top, bottom, base, view) -> None:
        received = {}

        def pre(grad_outputs):
            g = grad_outputs[0] if grad_outputs else None
            received["storage"] = g.untyped_storage()._cdata if g is not None else None

        def post(grad_inputs, grad_outputs):
            g = grad_inputs[0] if grad_inputs else None
            seen = received.pop("storage", None)
            if g is None or seen is None or g.untyped_storage()._cdata != seen:
                return None
            sizes, strides, offset = base
            shared = min(offset, view[2])
            extent = max(_min_storage(sizes, strides, offset - shared),
                         _min_storage(view[0], view[1], view[2] - shared))
            z = g.new_zeros((extent,))
            out = z.as_strided(sizes, strides, offset - shared)
            out.copy_(g)
            return (out,) + tuple(grad_inputs[1:])

        top.register_prehook(pre)
        bottom.register_hook(post)


def _min_storage(sizes, strides, offset: int) -> int:
    """Elements a strided tensor spans from its storage's start (ATen's `_min_storage_size`)."""
    if any(s == 0 for s in sizes):
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(sizes, strides))

