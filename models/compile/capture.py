"""torch.compile run on fake tensors, codegen only: what the compiled program is and what it did at run time.

The model is built on fake tensors as the traced describer builds it (models/trace: `FakeTensorMode`, the batch
with its values, frozen parameters), and `step.step_function` is compiled by dynamo with inductor as its backend
(`torch._inductor.compile_fx.compile_fx`: AOTAutograd's joint graph, the min-cut partitioner, decompositions, then
`inner_compile` once per forward and once per backward graph). Our `inner_compile` runs inductor's real
`compile_fx_inner` up to the wrapper's code (`GraphLowering.compile_to_module` replaced by codegen only: scheduling,
fusion, buffer reuse, the memory plan, no C++ compiler, no kernel run) and returns a `MockFXGraphCacheOutput` that
runs the partitioned aten graph on the fake tensors instead. One fake training step then runs through dynamo's and
AOTAutograd's real runtime: every graph break, every compiled forward and backward called in the order they run,
with the storages they were given and returned (`Run`), and the `.grad` each parameter ends with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from unittest import mock

from ..config import ConfigError, TrainingSetup
from ..trace import _adopt, _fake_batch, freeze
from ..trace.boundary import user_code
from ..trace.model import TracedModel
from ..trace.record import DTYPES, find_layers
from .plan import Plan, capture_plans
from .step import step_function, wrap_checkpointed


@dataclass
class Run:
    """One call of a compiled graph: its plan's index, and the storage keys of its arguments and results."""

    graph: int
    args: list
    outputs: list


@dataclass
class Capture:
    plans: list[Plan]
    runs: list[Run]
    storages: dict  # key -> (nbytes, dtype, shape) of every tensor the runs saw
    params: dict  # key -> parameter name (tied parameters: one name)
    param_specs: list  # (name, shape, dtype, requires_grad), named_parameters order
    buffers: dict  # key -> buffer name
    inputs: dict  # key -> batch tensor name
    held: set  # keys the caller's (out, loss) reach
    grads: dict  # parameter name -> key of its `.grad`
    graph_count: int = 0
    break_reasons: list = field(default_factory=list)
    layers: tuple = ()
    model_class: str = ""


class _CodegenOnly(Exception):
    pass


def _codegen_only(self):
    self.codegen()  # torch/_inductor/graph.py GraphLowering.codegen: scheduler, fusion, wrapper, memory plan
    raise _CodegenOnly()


def _key(t):
    import torch

    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


def _tensors(obj, depth: int = 0):
    """The tensors an output structure reaches (a HF ModelOutput, its cache's layers)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 5 or obj is None or isinstance(obj, (int, float, str, bool)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        for v in vars(obj).values():
            yield from _tensors(v, depth + 1)



def compile_capture(model: TracedModel, setup: TrainingSetup) -> Capture:
    """Compile and run one fake micro-batch of `model` under `setup` (see the module docstring)."""
    import torch
    import torch._dynamo
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._inductor.output_code import MockFXGraphCacheOutput
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        net, batch, loss_fn = model.build(setup)
        _adopt(net, mode)
        freeze(net, setup.frozen)
        batch, _ = _fake_batch(mode, batch)
    layers = find_layers(net)
    wrap_checkpointed(net, layers, setup)
    fn, tensors = step_function(net, batch, loss_fn)
    plans: list[Plan] = []
    runs: list[Run] = []
    seen: dict = {}
    keep: list = []  # every storage a run saw, so no key is reused while we look (not the tensor: AccumulateGrad
    # steals a gradient only when nothing else holds the tensor)

    def note(t):
        k = _key(t)
        if k is not None and k not in seen:
            st = t.untyped_storage()
            seen[k] = (st.nbytes(), DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape))
            keep.append(st)
        return k

    def inner(gm, example_inputs, **kw):
        before = len(plans)
        try:
            compile_fx_inner(gm, example_inputs, **kw)  # torch/_inductor/compile_fx.py, up to the wrapper's code
        except Exception as e:
            if not any(isinstance(x, _CodegenOnly) for x in (e, e.__cause__, e.__context__)):
                raise
        index = len(plans) - 1 if len(plans) > before else None

        def run(args):
            arg_keys = [note(a) for a in args]
            with mode:  # the aten graph on the fake tensors (its factory ops must make fake tensors too)
                outs = gm(*args)
            if index is not None:
                runs.append(Run(index, arg_keys, [note(o) for o in outs]))
            return outs

        run._boxed_call = True
        return MockFXGraphCacheOutput(gm=run)  # torch/_inductor/output_code.py: an OutputCode calling gm(args)

    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs, inner_compile=inner)

    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.prec.autocast or "")
    options = {"fx_graph_cache": False, **list_mode_options(setup.compile_mode)}
    torch._dynamo.reset()  # a new model: no guard of an earlier one, no recompile limit reached
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(inductor_config.patch(options))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
            stack.enter_context(mock.patch.object(GraphLowering, "compile_to_module", _codegen_only))
            stack.enter_context(capture_plans(plans))
            stack.enter_context(user_code(f"the {model.name} model compiled, forward, loss and backward"))
            compiled = torch.compile(fn, backend=backend, dynamic=False)
            with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                out, loss = compiled(*tensors)
            loss.backward()
    except ConfigError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError("compile", f"torch.compile of {model.name} failed on fake tensors: {type(e).__name__}: "
                                     f"{first}") from None
    finally:
        torch._dynamo.reset()
    params, specs = {}, []
    for name, p in net.named_parameters():
        params.setdefault(_key(p), name)
        specs.append((name, tuple(p.shape), DTYPES.get(p.dtype, str(p.dtype)), p.requires_grad))
    buffers = {}
    for name, b in net.named_buffers():
        buffers.setdefault(_key(b), name)
        note(b)
    inputs = {}
    names = list(batch) if isinstance(batch, dict) else [f"input{i}" for i in range(len(tensors))]
    names = [n for n in names if not isinstance(batch, dict) or isinstance(batch[n], torch.Tensor)]
    for name, t in zip(names, tensors):
        inputs[note(t)] = name
    held = {note(t) for t in list(_tensors(out)) + [loss]} - {None}
    grads = {name: note(p.grad) for name, p in net.named_parameters() if p.grad is not None}
    return Capture(plans=plans, runs=runs, storages=seen, params=params, param_specs=specs, buffers=buffers,
                   inputs=inputs, held=held, grads=grads, graph_count=len(graphs), layers=layers,
                   model_class=type(net).__name__)
