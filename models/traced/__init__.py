"""The traced describer: any nn.Module (a HF config or a user's factory) described by running it once.

How the pieces compose:
- `model.py`   `TracedModel`: what the model is (a HF config.json, or `file.py:factory`) and how to build
               it with its default batch (`hf_batch.py` for a HF model) and loss, on fake tensors or for real.
- `record.py`  runs one micro-batch (forward, loss, backward) on fake tensors under `FakeTensorMode` and
               records every aten op, storage birth and death, saved tensor and autograd node;
               `realpath.py` keeps that run on the real run's code path.
- `convert.py` turns a recording into the project's tape (models/tape.py) under a setup's checkpointing:
               forward ops with their saves, and the recorded backward nodes (`Tape.backward`).
- `cuda_program.py` makes that run the CUDA program where the model trains on a GPU (CUDA's autocast lists,
               the SDPA kernel torch picks, the fused dropout), `real_branches.py` the branches autograd takes
               on real tensors (formulas writing into their zeros, gradients summed in place), and
               `gpu_paths.py` adds what the CUDA kernels allocate inside themselves.
- `scale.py`   derives the recording of another micro-batch size from three traced ones of one program.
- `depth.py`   derives the recording of a HF model of n identical layers from traces of 3 and 4 layers (of
               layers that repeat every p, from 3p and 4p).
- here         `traced_tape` (what `models.training.build_tape` calls) and the trace cache. The same program
               built for real (CPU, random weights) to validate against is on the measuring side:
               traces/reference/traced.py `real_model`.

The cache: a recording depends on the model (its source digest: the config JSON, or the module file's
bytes), the micro-batch and sequence length, the parameter dtype, autocast's dtype, the frozen
parameters, the LoRA knobs (peft wraps a HF model when lora_r > 0), and whether any layer is checkpointed (a HF
model then runs without its KV cache, as transformers does under gradient checkpointing). It is kept per process
(`_CACHE`, the 16 latest), so max-batch, sweeps and explain trace a model once per shape; a changed module file has
a new digest, so an edit never reuses an old trace.
Checkpointing, accumulation, steps, optimizer and parallelism do not change the recording: they are
applied by `convert.to_tape` and the replay. Other micro-batch sizes: once three sizes of one model and
setup are traced and prove to be one program with sizes affine in the micro-batch, every other size is
derived from them (`scale.py`), not traced (1 is often a program of its own). Under `micro_batch_points`
(`peakledger simulate`, max-batch) a deep model's first trace records sizes 2, 3 and 4 beside its own, so that a
second call at another size derives it (`_other_sizes`).
"""

from __future__ import annotations

import atexit
import dataclasses
import fnmatch
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ..config import ConfigError, TrainingSetup
from ..tape import Tape
from . import store
from .boundary import user_code
from .gpu_paths import cuda_tape
from .model import TracedModel, from_hf_dict, from_module_spec

_CACHE: OrderedDict = OrderedDict()
CACHE_SIZE = 16
_DERIVED: set = set()  # cache keys whose recording was derived (scale.py), not traced
# the programs (`scale.signature` of the 3p layers' recording) whose depth derivation a trace of 4p layers has shown
# exact, per model and setup less the micro-batch and sequence length (`_group`): the same program at other sizes is
# derived from its 3p layers alone (its ops, storages and nodes are those of the one checked; only sizes differ, and
# the layers, one module repeated, take the same sizes one after the other)
_SHOWN: OrderedDict = OrderedDict()
# a recording's tapes (`traced_tape`: convert.py under the setup's checkpointing, gpu_paths.py's kernels), by the
# recording and what else the tape reads of the setup: explain's fixes and a GPU-count search re-simulate one
# recording under many optimizers and world sizes
_TAPES: OrderedDict = OrderedDict()
# a HF model's layer fingerprints (depth.py), by what its build reads of the setup (`_hf_build`): explain's
# candidates of another micro-batch or sequence length build the same modules
_PRINTS: OrderedDict = OrderedDict()


def forget() -> None:
    """This process's memory of traces dropped (what a new process starts from; the disk cache is kept). Also at
    the interpreter's exit (`atexit`): the recordings are then freed by reference counting, not walked and torn
    down by its final garbage collections (0.3 s at the end of docs/models.md's example)."""
    for cache in (_CACHE, _DERIVED, _SHOWN, _TAPES, _PRINTS):
        cache.clear()


atexit.register(forget)


def _bounded(cache: OrderedDict, key, value):
    """`value` kept under `key` as the most recent entry, the least recent ones dropped past CACHE_SIZE."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return value


def _kept(cache: OrderedDict, key, make):
    """The entry under `key` (now the most recent), else `make()` kept there (`_bounded`)."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    return _bounded(cache, key, make())


def model_key(model: TracedModel, setup: TrainingSetup) -> tuple:
    """The program a trace or a compile runs, as a cache key: the model's source and the batch knobs its
    factory takes (the recording and the compiled capture each add what else they depend on)."""
    mb = setup.batch.micro_batch if "micro_batch" in model.varies else None
    seq = setup.batch.seq_len if "seq_len" in model.varies else None
    return model.kind, model.source, model.digest, mb, seq


def _key(model: TracedModel, setup: TrainingSetup, target: tuple | None = None) -> tuple:
    return (*model_key(model, setup), setup.precision.param, setup.precision.autocast, setup.optimizer.frozen,
            setup.checkpointing.policy != "none", setup.lora, setup.batch.passes, target)


def same_recording(model: TracedModel, a: TrainingSetup, b: TrainingSetup) -> bool:
    """`model` under setups `a` and `b` is one recording (on any device): what differs between them is applied by
    convert.py and the replay (the optimizer, accumulation, parallelism, which layers are checkpointed, ...)."""
    return _key(model, a) == _key(model, b)


def check_setup(model: TracedModel, setup: TrainingSetup) -> None:
    if model.max_seq_len is not None and setup.batch.seq_len > model.max_seq_len:
        raise ConfigError("seq_len", f"{setup.batch.seq_len} exceeds the model's maximum positions {model.max_seq_len}")


def recording(model: TracedModel, setup: TrainingSetup, target: tuple | None = None, by_depth: bool = True):
    """The recording of one micro-batch of `model` under `setup` (cached, see the module docstring): the CPU
    program, or with `target` = (compute capability, torch version) the CUDA program (cuda_program.py). A model
    of many identical layers is derived from 3 and 4 of them (depth.py) unless `by_depth` is False (then traced
    whole, and not cached)."""
    key = _key(model, setup, target)
    if not by_depth:
        return _trace(model, setup, target)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    disk = store.entry(model, key, setup.lora.r, setup.lora.quantize)
    hit = disk.load() if disk is not None else None
    if hit is not None:
        return _remember(key, hit)
    check_setup(model, setup)
    if "micro_batch" in model.varies:  # three traced sizes of one affine program give every other size
        from .scale import derive
        points = {k[3]: r for k, r in _CACHE.items() if k[:3] == key[:3] and k[4:] == key[4:] and k not in _DERIVED}
        if disk is not None:
            points = {**disk.points(), **points}
        derived = derive(points, setup.batch.micro_batch)
        if derived is not None:
            _DERIVED.add(key)
            return _remember(key, derived)
    deep = _by_depth(model, setup, target, _other_sizes(model, setup, key, disk))
    rec = deep if deep is not None else _trace(model, setup, target)
    if disk is not None:
        disk.save(rec)
    return _remember(key, rec)


def _trace(model: TracedModel, setup: TrainingSetup, target: tuple | None):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .record import record

    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision.autocast or "")
    what = "module" if model.kind == "module" else "hf_config"
    program = None
    if target is not None:
        from .cuda_program import cuda_program
        program = cuda_program(*target)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        net, batch, loss_fn = model.build(setup)
        adopt(net, mode)
        freeze(net, setup.optimizer.frozen)
        batch, values = fake_batch(mode, batch)
        try:
            with user_code(f"the {model.name} model's forward, loss and backward"):
                rec = record(net, batch, loss_fn if setup.batch.passes == "train" else None, autocast=autocast,
                             values=values, program=program)
        except ConfigError:
            raise
        except Exception as e:  # the user's code, or an op fake tensors cannot run
            raise ConfigError(what, _trace_failure(e)) from None
    return rec


POINTS = (2, 3, 4)  # the micro-batch sizes a first trace of a deep model records beside its own (see `_other_sizes`)
_POINTS: ContextVar[bool] = ContextVar("peakledger_micro_batch_points", default=False)


@contextmanager
def micro_batch_points(on: bool) -> Iterator[None]:
    """Whether a first trace of a deep model records the other micro-batch sizes too (`_other_sizes`), for what runs
    inside. Off by default (a trace for explain's candidates, for each card of `where` or a sweep's point is a
    one-off); `peakledger simulate` turns it on for its scenario, the first of the calls a user makes about a model
    (then another micro-batch, max-batch: each derived, nothing traced), and a max-batch search for its probes
    (peakledger/api.py `max_micro_batch`: the first size it traces records the others it needs)."""
    token = _POINTS.set(on)
    try:
        yield
    finally:
        _POINTS.reset(token)


def _other_sizes(model: TracedModel, setup: TrainingSetup, key: tuple, disk) -> tuple[int, ...]:
    """The micro-batch sizes of POINTS a first trace records beside its own, so that every other size is derived
    from three of one program (scale.py) and a second call at another micro-batch traces nothing: none where
    three sizes from 2 up are had already (this process's cache, the disk's), where the micro-batch is not a knob of
    the model (a factory's fixed batch) or where `micro_batch_points(False)` is in force. A size of 1 is left out:
    it is often a program of its own (a size-1 dimension lets a reshape skip its copy)."""
    if not _POINTS.get() or "micro_batch" not in model.varies:
        return ()
    have = {k[3] for k in _CACHE if k[:3] == key[:3] and k[4:] == key[4:]} | set(disk.sizes() if disk else ())
    have.add(setup.batch.micro_batch)
    if sum(b >= 2 for b in have) >= len(POINTS):
        return ()
    return tuple(b for b in POINTS if b not in have)


def _by_depth(model: TracedModel, setup: TrainingSetup, target: tuple | None, others: tuple[int, ...] = ()):
    """The recording of a HF model of many layers derived from traces of few (depth.py), or None where it cannot be
    shown exact. Its layers must repeat with a period p, module for module (`depth.period`: 1 where all are
    alike, 2 where two kinds alternate), and it is traced with 3p and 4p layers, whose layers must be the n-layer
    model's first ones, module for module; the derivation of 4p layers from 3p must equal their trace (not traced
    again where this process has shown it for the same program at other sizes: `_SHOWN`). The same is
    done at the micro-batch sizes `others` (the traces shared out with `setup`'s own), each kept in the caches as
    its own first trace would be, derived from its trace of 3p layers (the layers' period is the model's, shown at
    setup's size; scale.py checks the three it derives any other size from: one program, the same ops and
    storages, every size affine)."""
    from . import depth

    if model.kind != "hf":
        return None
    data = model.hf_dict()
    key = depth.layer_key(data)
    n = data.get(key) if key else None
    if not isinstance(n, int) or n <= depth.TRACED + 1:
        return None
    prints = _fingerprints(model, setup)
    p = depth.period_of(prints)
    if p is None or n <= (depth.TRACED + 1) * p:
        return None
    kinds = data.get("layer_types")  # a HF config's per-layer list (transformers' layer_type_validation)
    depths = (depth.TRACED * p, (depth.TRACED + 1) * p)
    shallow_models = [from_hf_dict({**data, key: k, **({"layer_types": kinds[:k]} if isinstance(kinds, list) else {})},
                                   model.name) for k in depths]
    if any(_fingerprints(m, setup) != prints[:k] for m, k in zip(shallow_models, depths)):
        return None
    from .scale import signature

    setups = [setup]
    for b in others:
        try:
            setups.append(setup.replace(micro_batch=b))
        except ConfigError:  # (a size this setup refuses: not recorded)
            continue
    # 3p and 4p layers at setup's size (the derivation checked), 3p layers only at the others; 3p only at setup's
    # size too where a 4p trace has shown the derivation of this program exact at another size (`_SHOWN`)
    group = _group(_key(model, setup, target))
    shown = _SHOWN.get(group, {})  # program -> the micro-batch it was shown at
    # (traced beside the others unless a program shown is likely this one: one shown at a micro-batch of 1 where this
    # is 1, else one shown at 2 or more, a size of 1 being often a program of its own; the deepest trace first, so that
    # the two processes end together)
    likely = any((b > 1) == (setup.batch.micro_batch > 1) for b in shown.values())
    check = [] if likely else [(shallow_models[1], setup)]
    shallow = _shallow([(shallow_models[0], setup), *check] + [(shallow_models[0], s) for s in setups[1:]], target)
    three, at_others = shallow[0], shallow[1 + len(check):]
    program = signature(three)
    try:
        if program not in shown:
            four = shallow[1] if check else _shallow([(shallow_models[1], setup)], target)[0]
            if not depth.same(depth.derive(three, (depth.TRACED + 1) * p, p), four):
                return None
        rec = depth.derive(three, n, p)
    except depth.NotPeriodic:
        return None
    _bounded(_SHOWN, group, {program: setup.batch.micro_batch, **shown})
    for s, other in zip(setups[1:], at_others):
        try:
            derived = depth.derive(other, n, p)
        except depth.NotPeriodic:
            continue
        k = _key(model, s, target)
        disk = store.entry(model, k, s.lora.r, s.lora.quantize)
        if disk is not None:
            disk.save(derived)
        _remember(k, derived)
    return rec


def _fingerprints(model: TracedModel, setup: TrainingSetup):
    """depth.fingerprints of a HF model (cached in `_PRINTS`): its build reads the config, whether layers are
    checkpointed (`use_cache`), the parameter dtype and the LoRA knobs of the setup (model.py `_hf_build`)."""
    from . import depth

    key = (model.source, setup.checkpointing.policy != "none", setup.precision.param, setup.lora)
    return _kept(_PRINTS, key, lambda: depth.fingerprints(model, setup))


def _group(key: tuple) -> tuple:
    """A recording's key (`_key`) less its micro-batch and sequence length."""
    return key[:3] + key[5:]


def _shallow(jobs: list[tuple[TracedModel, TrainingSetup]], target: tuple | None) -> list:
    """The recordings of the shallow models of depth derivations, (model, setup) each: those not cached (here or on
    disk) traced two at a time, this process and a forked child each taking the next (models/forked.py
    `shared_map`: a trace is one Python thread; what the child cannot do is traced here, the same recording either
    way), each kept in the caches as `recording` keeps it."""
    from ..forked import shared_map

    todo = [i for i, (m, s) in enumerate(jobs) if not _cached(m, s, target)]
    got = dict(zip(todo, shared_map(lambda i: recording(*jobs[i], target), todo)))
    out = []
    for i, (m, s) in enumerate(jobs):
        if i not in got:
            out.append(recording(m, s, target))
            continue
        key = _key(m, s, target)
        disk = store.entry(m, key, s.lora.r, s.lora.quantize)
        if disk is not None and not disk.path.exists():  # (the child saved it, unless its folder could not be written)
            disk.save(got[i])
        out.append(_remember(key, got[i]))
    return out


def _cached(model: TracedModel, setup: TrainingSetup, target: tuple | None) -> bool:
    """`model`'s recording is in this process's cache or on disk."""
    key = _key(model, setup, target)
    if key in _CACHE:
        return True
    disk = store.entry(model, key, setup.lora.r, setup.lora.quantize)
    return disk is not None and disk.path.exists()


def _remember(key: tuple, rec):
    _CACHE[key] = rec
    while len(_CACHE) > CACHE_SIZE:
        _DERIVED.discard(_CACHE.popitem(last=False)[0])
    return rec


def _trace_failure(e: Exception) -> str:
    """What went wrong while tracing, in words: a value the trace cannot know, an op with no fake-tensor rule,
    or the model's own error; with the module it happened in."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    where = getattr(e, "peakledger_where", None)
    at = f" (in module {where})" if where else ""
    first = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, DataDependentOutputException):
        return (f"the model reads a tensor's value{at}: {first} (a Python `if` on a float tensor, `.item()`, "
                "`.tolist()`); peakledger traces on fake tensors, which have shapes but no float values")
    if isinstance(e, DynamicOutputShapeException):
        return (f"an op's output shape depends on tensor values{at}: {first} (nonzero, masked_select, unique); "
                "peakledger traces on fake tensors, which have no float values")
    if isinstance(e, UnsupportedOperatorException):
        return f"an op has no fake-tensor implementation{at}: {first}; peakledger cannot trace it"
    return f"the model failed while traced on fake tensors{at}: {type(e).__name__}: {first}"


def adopt(net, mode) -> None:
    """Parameters and buffers that are not this mode's fake tensors (real ones, or fake ones of another mode, as
    `copy.deepcopy` of a module makes: nn.TransformerEncoder clones its layers so) become this mode's, once:
    otherwise every op would convert them anew, a new storage each time."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    for module in net.modules():
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is None or (isinstance(t, FakeTensor) and t.fake_mode is mode):
                    continue
                fake = mode.from_tensor(t.detach() if isinstance(t, torch.nn.Parameter) else t)
                if table is module._parameters:
                    fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
                table[key] = fake


def fake_batch(mode, batch):
    """The batch as fake tensors, with the real values of those that had them (a HF batch is built real)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_map

    values = {}

    def fake(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor):
            return t
        f = mode.from_tensor(t)
        values[f] = t
        return f

    return tree_map(fake, batch), values


def freeze(net, patterns) -> None:
    names = [n for n, _ in net.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError("frozen", f"pattern {pattern!r} matches no parameter (names look like {names[0]!r})")
    for n, p in net.named_parameters():
        if any(fnmatch.fnmatchcase(n, pat) for pat in patterns):
            p.requires_grad_(False)


def traced_layers(model: TracedModel, setup: TrainingSetup) -> tuple[str, ...]:
    """The repeated blocks of a traced model (its checkpointable layers, FSDP units), from its recording (any
    program's: the module tree is the same on every device)."""
    key = _key(model, setup)[:-1]
    hit = next((r for k, r in _CACHE.items() if k[:-1] == key), None)
    return (hit or recording(model, setup)).layers


def traced_versions(model: TracedModel, setup: TrainingSetup) -> str:
    """The libraries the trace ran, as installed: "torch 2.13.0+cpu, transformers 5.25.0", and peft with LoRA. A HF
    config's are read from the packages' metadata (store.py: a recording read from the disk cache imports none of
    them); a module factory's from the modules its process imported."""
    import sys

    if model.kind == "hf":
        used = ("torch", "transformers") + (("peft",) if setup.lora.r else ())
        return ", ".join(f"{n} {store.version(n)}" for n in used)
    import torch

    used = ("transformers",) + (("peft",) if setup.lora.r else ())
    names = [("torch", torch)] + [(n, sys.modules[n]) for n in used if n in sys.modules]
    return ", ".join(f"{n} {getattr(m, '__version__', '?')}" for n, m in names)


def traced_tape(model: TracedModel, setup: TrainingSetup, cpu: bool = False,
                cuda: tuple[tuple[int, int], str] | None = None) -> Tape:
    """The recording as a tape: the CPU program (`cpu`), or the CUDA program of `cuda` = (compute capability,
    torch version), recorded as torch dispatches for CUDA tensors (cuda_program.py), with the CUDA kernels'
    temporaries no fake kernel shows (gpu_paths.py)."""
    from .convert import to_tape

    target = None if cpu else tuple(cuda or ((9, 0), "2.6"))
    rec = recording(model, setup, target)
    describer = f"traced ({model.kind}: {rec.model_class}; {traced_versions(model, setup)})"
    # what convert.py reads of the setup besides the recording (the segments: checkpoint_segments)
    key = (id(rec), setup.checkpointing, setup.loop.holds_outputs, setup.batch.passes, setup.precision.param,
           describer, target)
    def make():  # (the entry holds the recording: its id names no other while the entry is there)
        tape = to_tape(rec, setup, rec.layers, describer=describer)
        return rec, tape if cpu else cuda_tape(tape, *target)

    tape = _kept(_TAPES, key, make)[1]  # (a copy of its lists: a caller may change the tape it is given)
    return dataclasses.replace(tape, params=list(tape.params), ops=list(tape.ops), inputs=list(tape.inputs),
                               buffers=list(tape.buffers), param_dtypes=dict(tape.param_dtypes))


__all__ = ["TracedModel", "from_hf_dict", "from_module_spec", "traced_tape", "traced_layers", "recording", "forget",
           "same_recording",
           "freeze", "micro_batch_points", "POINTS"]
