"""torch.compile run on fake tensors, codegen only: what the compiled program is and what it did at run time.

The model is built on fake tensors as the traced describer builds it (models/traced: `FakeTensorMode`, the batch
with its values, frozen parameters), and `step.step_function` is compiled by dynamo with inductor as its backend
(`torch._inductor.compile_fx.compile_fx`: AOTAutograd's joint graph, the min-cut partitioner, decompositions, then
`inner_compile` once per forward and once per backward graph). Our `inner_compile` runs inductor's real
`compile_fx_inner` up to the wrapper's code (`GraphLowering.compile_to_module` replaced by codegen only: scheduling,
fusion, buffer reuse, the memory plan, no C++ compiler, no kernel run; C++ kernels written scalar only, no vector
ISA picked: the scalar kernel is written first and alone decides which buffers a kernel keeps to itself or updates
in place, torch/_inductor/codegen/cpp.py `CppKernelProxy.codegen_functions` `removed_buffers` / `inplaced_to_remove`,
the vectorized variants after it change no allocation of the plan, and writing them was a quarter of a compile)
and returns a `MockFXGraphCacheOutput` that runs the partitioned aten graph on the fake tensors instead. One fake
training step then runs through dynamo's and AOTAutograd's real runtime: every graph break, every compiled forward
and backward called in the order they run, with the storages they were given and returned (`Run`), and the `.grad`
each parameter ends with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from unittest import mock

from ..config import ConfigError, TrainingSetup
from ..traced import adopt, fake_batch, freeze
from ..traced.boundary import user_code
from ..traced.model import TracedModel
from ..traced.record import DTYPES, FlopCount, find_layers
from .plan import Plan, capture_plans, workspaces
from .step import CPU_THREADS, step_function, wrap_checkpointed


@dataclass
class Run:
    """One call of a compiled graph: its plan's index, and the storage keys of its arguments and results."""

    graph: int
    args: list
    outputs: list
    flops: int = 0  # the graph's FLOPs (traced/recorder.py `op_flops` on its aten ops, as traced tapes count them)


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
    param_strides: dict = field(default_factory=dict)  # parameter name -> its strides (the gradient layout contract)
    ties: tuple = ()  # (name, the parameter it is, untied parameters registered before it): models/tape.py
    graph_count: int = 0
    break_reasons: list = field(default_factory=list)
    layers: tuple = ()
    model_class: str = ""


class _CodegenOnly(Exception):
    pass


def _codegen_only(self):
    self.codegen()  # torch/_inductor/graph.py GraphLowering.codegen: scheduler, fusion, wrapper, memory plan
    _report_output_strides(self)
    raise _CodegenOnly()


def _report_output_strides(graph) -> None:
    """The strides of the graph's outputs in inductor's layouts, handed to the caller as a compiled graph hands them
    (torch/_inductor/utils.py `set_tracing_context_output_strides`, from `CompiledFxGraph.output_strides`): a
    forward's saved tensors in the layouts inductor chose (channels-last for a convolution, `layout_optimization`),
    with which AOTAutograd restrides the backward's placeholders before compiling it
    (torch/_functorch/_aot_autograd/graph_compile.py `_aot_stage2b_bw_compile`), so that the backward is lowered
    for the layouts the real forward returns."""
    import torch
    from torch._inductor import ir

    context = torch._guards.TracingContext.try_get()
    if context is None or context.output_strides is None or context.output_strides:
        return
    for out in graph.graph_outputs or ():
        stride = None
        if isinstance(out, ir.IRNode) and out.has_tensor_output():
            try:
                stride = tuple(int(graph.sizevars.optimization_hint(s)) for s in out.get_layout().stride)
            except Exception:  # an unbacked size: inductor reports none either
                stride = None
        context.output_strides.append(stride)


def _on_cuda(net, batch):
    """The fake model's parameters and buffers, and the batch, as fake tensors on `cuda:0` (the model as
    `model.to("cuda")` leaves it; `Module.to` itself cannot move fake parameters: it swaps tensors, which a fake
    tensor's weak references refuse); tied parameters stay one. `cuda:0`, not `cuda`: a device without an index
    makes C++ ask the driver for the current one."""
    import torch
    from torch.utils._pytree import tree_map

    moved: dict[int, object] = {}
    for module in net.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                new = moved.get(id(t))
                if new is None:
                    data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda:0")
                    new = torch.nn.Parameter(data, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else data
                    moved[id(t)] = new
                table[name] = new
    return tree_map(lambda x: x.to("cuda:0") if isinstance(x, torch.Tensor) else x, batch)


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



def _as_planned(outs, args, plan: Plan):
    """The forward's outputs as inductor's program returns them: an output the plan makes a buffer of its own
    (a layout inductor chose: the channels-last copy of a conv's weight or input, `layout_optimization`) where
    the aten graph returns the input itself gets a storage of its own, so that the backward which saves it
    receives, and frees at its `del`, that copy and not the parameter."""
    import torch

    if len(outs) != len(plan.outputs):
        return outs
    inputs = set(plan.inputs)
    arg_storages = {_key(a) for a in args} - {None}
    out = list(outs)
    for i, (o, name) in enumerate(zip(outs, plan.outputs)):
        if name is None or name in inputs or not isinstance(o, torch.Tensor) or _key(o) not in arg_storages:
            continue
        out[i] = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
    return type(outs)(out) if isinstance(outs, (list, tuple)) else out


def _eager_checkpoint(model: TracedModel, setup: TrainingSetup, reasons: list[str]) -> None:
    """Refuse a checkpointed model whose checkpoint dynamo could not keep in its graph. Dynamo traces
    `torch.utils.checkpoint.checkpoint` as a higher-order op, and gives it up when the checkpointed forward has a side
    effect outside it (torch/_dynamo/variables/higher_order_ops.py: "HOP: Unsafe side effect"; HF Llama: the `kernels`
    hub layers' `CompileableContextVar.set` assigns a global in the forward): the checkpoint call then breaks the graph
    and runs eagerly, and with it the layer under it (eager checkpoint: its pack hooks, its recompute in the backward,
    frames dynamo skips), between the compiled graphs. That eager program is not modelled under compile yet."""
    if setup.checkpointing.policy == "none":
        return
    hop = [r for r in reasons if r.startswith("HOP:")]
    if not hop:
        return
    lines = [x.strip() for x in hop[0].splitlines() if x.strip()]
    context = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("Developer debug context:")), "")
    raise ConfigError("checkpointing", f"{setup.checkpointing.policy} with compile: dynamo could not keep "
                                       f"torch.utils.checkpoint in the graph of {model.name} ({lines[0]}"
                                       f"{': ' + context if context else ''}), so its checkpointed layers run "
                                       "eagerly between compiled graphs, which is not modelled yet; allowed with "
                                       "compile here: checkpointing none")


def compile_capture(model: TracedModel, setup: TrainingSetup, cuda: bool = False) -> Capture:
    """Compile and run one fake micro-batch of `model` under `setup` (see the module docstring); `cuda`: the model
    and batch on fake `cuda:0` tensors, inductor's CUDA (triton) program for the device torch sees (a CUDA build of
    torch; gpu.py `gpu_check` checks it against the device profile)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa, list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._inductor.output_code import MockFXGraphCacheOutput
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        net, batch, loss_fn = model.build(setup)
        adopt(net, mode)
        freeze(net, setup.optimizer.frozen)
        batch, _ = fake_batch(mode, batch)
        if cuda:
            batch = _on_cuda(net, batch)
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
            with mode, FlopCount() as counter:  # the aten graph on the fake tensors (its
                outs = gm(*args)  # factory ops must make fake tensors too), its FLOPs counted
                if index is not None and not plans[index].is_backward:
                    outs = _as_planned(outs, args, plans[index])
            if index is not None:
                runs.append(Run(index, arg_keys, [note(o) for o in outs], counter.total))
            return outs

        run._boxed_call = True
        return MockFXGraphCacheOutput(gm=run)  # torch/_inductor/output_code.py: an OutputCode calling gm(args)

    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs, inner_compile=inner)

    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision.autocast or "")
    options = {"fx_graph_cache": False, "cpp.threads": CPU_THREADS, **list_mode_options(setup.compile.mode)}
    torch._dynamo.reset()  # a new model: no guard of an earlier one, no recompile limit reached
    breaks = counters["graph_break"]
    seen_breaks = dict(breaks)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(inductor_config.patch(options))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
            stack.enter_context(mock.patch.object(GraphLowering, "compile_to_module", _codegen_only))
            stack.enter_context(mock.patch.object(cpu_vec_isa, "pick_vec_isa", lambda: cpu_vec_isa.invalid_vec_isa))
            stack.enter_context(capture_plans(plans))
            stack.enter_context(user_code(f"the {model.name} model compiled, forward, loss and backward"))
            compiled = torch.compile(fn, backend=backend, dynamic=False)
            with torch.autocast("cuda" if cuda else "cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                out, loss = compiled(*tensors)
            with mode:  # the zeros autograd makes for an output without a gradient (the logits, 1 GiB at Llama-3-8B
                loss.backward()  # sizes: torch/csrc/autograd/python_function.cpp `to_py_args`) fake too, not real
    except ConfigError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError("compile", f"torch.compile of {model.name} failed on fake tensors: {type(e).__name__}: "
                                     f"{first}") from None
    finally:
        torch._dynamo.reset()
    reasons = [r for r, n in breaks.items() if n > seen_breaks.get(r, 0)]
    _eager_checkpoint(model, setup, reasons)
    workspaces(plans, None if cuda else CPU_THREADS)  # GEMMs' FLOPs; on the CPU their own memory (workspace.py)
    params, specs, strides, ties = {}, [], {}, []
    for name, p in net.named_parameters(remove_duplicate=False):
        if _key(p) in params:  # a tied parameter (transformers' tie_weights): the same tensor under a 2nd name
            ties.append((name, params[_key(p)], len(specs)))
            continue
        params[_key(p)] = name
        specs.append((name, tuple(p.shape), DTYPES.get(p.dtype, str(p.dtype)), p.requires_grad))
        strides[name] = tuple(p.stride())
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
                   inputs=inputs, held=held, grads=grads, param_strides=strides, ties=tuple(ties),
                   graph_count=len(graphs),
                   break_reasons=reasons, layers=layers,
                   model_class=type(net).__name__)
