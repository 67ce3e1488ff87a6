"""A compiled program's run (capture.py) as the project's tape (models/tape.py): the same contract as a traced tape,
so the replay, the optimizer, the engines' hooks and the reports take it unchanged.

Each graph's memory plan (plan.py) is replayed on the storages its run was given: buffers allocated, handed on
(reuse, reinterpret: one storage under two names) and freed where the wrapper drops the storage's last name.
- Forward: the compiled forwards' events, in the order they ran, as tape ops, each a run of allocations then a run
  of frees (`releases`). What a forward returns lives on past its graph: the caller's `(out, loss)` (`held`, until
  backward ends), the tensors a backward graph takes as saved (`saves` of a save op, one per group released
  together), and the rest, locals of the compiled frame between graphs, until the forward ends.
- Backward: the compiled backwards in the order the engine ran them, as `GradNode`s. Before a node: the gradients
  made for it outside any graph (the `ones_like` of the loss, which `torch.autograd.backward` holds until the whole
  backward returns; AOTAutograd's zeros for the outputs no gradient reached). The zeros, and a gradient an earlier
  node (the graph after a break) made, are the graph's own from torch 2.13 on, freed at its `del` of them
  (`zeros_held`). In it: its buffers; a saved tensor is released
  at the wrapper's `del` of it (AOTAutograd clears the node's saved tensors before calling the graph); a buffer
  returned as a parameter's gradient is that parameter's `.grad` (AccumulateGrad steals it: the step names the
  parameter, `grads`), unless its strides break the gradient layout contract with the parameter's (a channels-last
  convolution weight gradient): AccumulateGrad then makes `.grad` a copy in the parameter's layout and the buffer
  goes (torch/csrc/autograd/functions/accumulate_grad.h "Case 1.5", `clone_obey_contract`). At its end: the
  gradients the engine gave it, below torch 2.13 (`CompiledFunction.backward`'s arguments hold them until it
  returns), and what it returned that no later node takes.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from ...simulator.torch_rules import nearest
from ..config import ConfigError, TrainingSetup, dtype_bytes
from ..tape import GradNode, GradStep, ParamSpec, Tape, TapeOp, TensorSpec
from .capture import Capture


def _spec(name: str, nbytes: int, dtype: str, shape: tuple) -> TensorSpec:
    try:
        size = dtype_bytes(dtype)
    except ConfigError:
        return TensorSpec(name, (nbytes,), "int8")
    if prod(shape) * size == nbytes:
        return TensorSpec(name, tuple(shape), dtype)
    if nbytes % size == 0:
        return TensorSpec(name, (nbytes // size,), dtype)
    return TensorSpec(name, (nbytes,), "int8")


class _Storage:
    __slots__ = ("spec", "born", "graph", "refs", "shape", "stride")

    def __init__(self, spec: TensorSpec, born: str, graph: int, shape: tuple = (), stride: tuple | None = None):
        self.spec, self.born, self.graph, self.refs, self.shape, self.stride = spec, born, graph, 0, shape, stride


def _obeys_layout_contract(shape: tuple, stride: tuple | None, param_stride: tuple | None) -> bool:
    """Whether AccumulateGrad may steal a gradient of these strides for a parameter of `param_stride` (a dense
    parameter): every dimension of size > 1 strided as the parameter's, no 0 stride elsewhere
    (torch/csrc/autograd/utils/grad_layout_contract.h `obeys_layout_contract`). Unknown strides: it may."""
    if stride is None or param_stride is None or len(stride) != len(shape) or len(param_stride) != len(shape):
        return True
    return all((g == p) if n != 1 else g != 0 for n, g, p in zip(shape, stride, param_stride))


def _segments(events: list[tuple]) -> list[tuple[list, list, int]]:
    """Events ("alloc", x) / ("free", x) / ("flops", n) as runs of allocations followed by runs of frees, each with
    the FLOPs of the kernels that ran in it."""
    out: list[tuple[list, list, list]] = []
    for kind, x in events:
        if kind == "alloc" and (not out or out[-1][1]):
            out.append(([], [], [0]))
        elif not out:
            out.append(([], [], [0]))
        if kind == "flops":
            out[-1][2][0] += x
        else:
            out[-1][0 if kind == "alloc" else 1].append(x)
    return [(allocs, frees, flops[0]) for allocs, frees, flops in out]


def _flop_shares(plan, total: int) -> list[int]:
    """A graph run's FLOPs (`Run.flops`, all its aten ops) shared among its extern GEMMs (plan.py's ("gemm", name,
    flops) events) in proportion to theirs: the GEMMs are where a compiled graph's FLOPs are; what the rest (an SDPA
    fallback, a convolution) counts goes with them; no GEMM: none (the caller puts it all at the graph's start)."""
    gemms = [ev[2] for ev in plan.events if ev[0] == "gemm"]
    weight = sum(gemms)
    if not weight:
        return [total] + [0] * (len(gemms) - 1) if gemms else []
    shares, done, acc = [], 0, 0
    for g in gemms:
        acc += g
        upto = total * acc // weight
        shares.append(upto - done)
        done = upto
    return shares


def zeros_held(version: str) -> bool:
    """Whether the gradients a compiled backward is given (AOTAutograd's zeros for the outputs no gradient reached,
    the gradient the graph after a break made) stay alive until it returns: up to torch 2.12
    `CompiledFunction.backward(ctx, *flat_args)` holds them in its arguments' tuple (measured on the H200 snapshots,
    torch 2.11: 525 MB of zeros at llama-1b's backward); torch 2.13's generated prologue clears the list the engine
    passes (`flat_args.clear()`, torch/_functorch/_aot_autograd/runtime_wrappers.py), so each goes at the wrapper's
    `del` of it (measured on this CPU: the zeros, and the logits' gradient between a LoRA GPT-2's graphs). The
    release's rule set says (simulator/torch_rules `compiled_backward_clears_grads`; 2.12, not modelled, follows
    2.11)."""
    return not nearest(version).compiled_backward_clears_grads


def to_tape(cap: Capture, setup: TrainingSetup, describer: str, torch_version: str = "2.13") -> Tape:
    """The capture's tape (see the module docstring); `torch_version`: the torch that ran the capture."""
    held_zeros = zeros_held(torch_version)
    external = set(cap.params) | set(cap.buffers) | set(cap.inputs)
    of_key: dict = {}  # runtime storage key -> _Storage (graph-made storages)
    storages: list[_Storage] = []
    fwd: list[tuple] = []  # ("alloc" | "free", _Storage), ("flops", n)
    bwd: list[tuple] = []  # per backward run: (graph, [events]); events ("alloc"/"free"/"grad"/"release", ...)
    runs_bw = [r for r in cap.runs if cap.plans[r.graph].is_backward]
    taken_later: dict[int, set] = {}  # backward run index -> keys later backward runs take
    for i in range(len(runs_bw)):
        taken_later[i] = {k for r in runs_bw[i + 1:] for k in r.args}
    grad_of_key: dict = {}
    for p, k in cap.grads.items():
        if k in grad_of_key:
            raise ConfigError("compile", f"parameters {grad_of_key[k]} and {p} share one gradient storage in the "
                                         "compiled backward; not modelled yet")
        grad_of_key[k] = p
    copied: set[str] = set()  # parameters whose `.grad` AccumulateGrad copies from the compiled backward's output
    returned_fwd: list[_Storage] = []
    save_groups: list[list[_Storage]] = []
    seeds: list[_Storage] = []  # the loss's ones the engine starts the backward with
    b = -1
    for run in cap.runs:
        plan = cap.plans[run.graph]
        backward = plan.is_backward
        if backward:
            b += 1
        elif b >= 0:
            raise ConfigError("compile", f"compiled forward graph {run.graph} ran during the backward (a recompute "
                                         "outside the compiled graphs: eager checkpointing around them); not "
                                         "modelled yet")
        names: dict[str, object] = {}  # wrapper name -> _Storage, or a key of an external tensor
        events: list[tuple] = []
        arg_storages: dict[int, int] = {}  # id(_Storage) -> names of it among this graph's arguments
        given: list[_Storage] = []  # gradients the engine gave this node (held until it returns)
        if len(plan.inputs) != len(run.args):
            raise ConfigError("compile", f"graph {run.graph} was called with {len(run.args)} arguments for "
                                         f"{len(plan.inputs)} inputs; not modelled")
        for name, key in zip(plan.inputs, run.args):
            if key is None or key in external:
                names[name] = key
                continue
            s = of_key.get(key)
            if s is None:
                nbytes, dtype, shape = cap.storages[key]
                if not backward:
                    raise ConfigError("compile", f"compiled graph {run.graph} reads a tensor made by eager code "
                                                 f"before it ({name}: {nbytes} B, after a graph break); eager code "
                                                 "between compiled graphs is not modelled yet")
                s = _Storage(_spec(f"g{run.graph}.{name}", nbytes, dtype, shape), "glue", run.graph)
                of_key[key] = s
                storages.append(s)
                events.append(("alloc", s))
            names[name] = s
            arg_storages[id(s)] = arg_storages.get(id(s), 0) + 1
            if backward and s.born == "glue" and s.spec.shape == ():
                seeds.append(s)  # the loss's ones: `torch.autograd.backward` holds them until the backward ends
            elif backward and s.born in ("glue", "backward") and not held_zeros:
                # zeros AOTAutograd materialises for an output no gradient reached, or the gradient an earlier node
                # made: the compiled backward's own once its prologue clears the engine's list, gone at its `del`
                s.refs = 1
                arg_storages.pop(id(s))
            elif backward and (name.startswith("tangents_") or s.born in ("glue", "backward")):
                given.append(s)  # the engine's, until the node returns: zeros, a gradient an earlier node made
        released: list[_Storage] = []
        shares = _flop_shares(plan, run.flops)  # one per extern GEMM
        if not shares:
            events.append(("flops", run.flops))
        for ev in plan.events:
            if ev[0] == "gemm":
                events.append(("flops", shares.pop(0)))
            elif ev[0] == "alloc":
                _, name, nbytes, dtype, shape, stride = ev
                s = _Storage(_spec(f"g{run.graph}.{name}", nbytes, dtype, shape),
                             "backward" if backward else "forward", run.graph, shape, stride)
                s.refs = 1
                storages.append(s)
                names[name] = s
                events.append(("alloc", s))
            elif ev[0] == "alias":
                s = names.get(ev[2])
                names[ev[1]] = s
                if isinstance(s, _Storage):
                    if id(s) in arg_storages:
                        arg_storages[id(s)] += 1
                    else:
                        s.refs += 1
            else:
                s = names.pop(ev[1], None)
                if not isinstance(s, _Storage):
                    continue
                if id(s) in arg_storages:  # a graph argument: its last name here lets go of the graph's reference
                    arg_storages[id(s)] -= 1
                    if arg_storages[id(s)] == 0 and backward and s.born == "forward":
                        if events and events[-1][0] == "release":
                            events[-1][1].append(s)
                        else:
                            events.append(("release", [s]))
                        released.append(s)
                    continue
                s.refs -= 1
                if s.refs == 0:
                    events.append(("free", s))
        outs = []
        for name, key in zip(plan.outputs, run.outputs):
            s = names.get(name) if name is not None else None
            outs.append(s)
            if isinstance(s, _Storage) and key is not None:
                of_key[key] = s
        out_set = {id(s) for s in outs if isinstance(s, _Storage)}
        for s in dict.fromkeys(x for x in names.values() if isinstance(x, _Storage)):
            if id(s) not in arg_storages and s.refs > 0 and id(s) not in out_set:
                s.refs = 0
                events.append(("free", s))  # a local of `call` dropped when it returns
        if not backward:
            fwd.extend(events)
            returned_fwd.extend(s for s in outs if isinstance(s, _Storage) and s.born == "forward")
            continue
        # the saved tensors the graph never dropped: released as it returns
        rest = [s for s in dict.fromkeys(names[n] for n in plan.inputs if isinstance(names.get(n), _Storage))
                if s.born == "forward" and s not in released]
        if rest:
            events.append(("release", rest))
        for s, key in zip(outs, run.outputs):  # AccumulateGrad's copy of a gradient it may not steal
            p = grad_of_key.get(key)
            if (isinstance(s, _Storage) and p is not None and s.born == "backward"
                    and not _obeys_layout_contract(s.shape, s.stride, cap.param_strides.get(p))):
                copied.add(p)
                events.append(("accum", p, s))
        for s in given:  # the engine lets go of the node's inputs as it returns
            if id(s) not in out_set:
                events.append(("free", s))
        for s, key in zip(outs, run.outputs):
            if not isinstance(s, _Storage) or s.born != "backward" or key in taken_later[b]:
                continue
            if key not in grad_of_key:
                events.append(("free", s))  # returned, taken by nobody
        bwd.append((run.graph, events))
    if bwd:
        bwd[-1][1].extend(("free", s) for s in dict.fromkeys(seeds))
    # which storages became gradients: their allocation is the parameter's `.grad` (the engine makes it)
    grad_param = {id(of_key[k]): p for k, p in grad_of_key.items() if k in of_key and p not in copied}
    missing = [p for k, p in grad_of_key.items() if k not in of_key]
    if missing:
        raise ConfigError("compile", f"the .grad of {missing[0]} is not a compiled backward's output (a copy "
                                     "AccumulateGrad made); not modelled yet")
    # -- the forward as tape ops
    spec_name = {id(s): s.spec.name for s in storages}
    ops: list[TapeOp] = []
    for k, (allocs, frees, flops) in enumerate(_segments(fwd)):
        ops.append(TapeOp(name=f"compiled.forward.{k}", kind="compiled", inputs=(), flops=flops,
                          outputs=tuple(s.spec for s in allocs), releases=tuple(spec_name[id(s)] for s in frees)))
    marker: dict[int, int] = {}  # id of a save group's list -> its op index
    for _, events in bwd:
        for ev in events:
            if ev[0] == "release":
                marker[id(ev[1])] = len(ops)
                save_groups.append(ev[1])
                ops.append(TapeOp(name=f"compiled.saved.{len(save_groups) - 1}", kind="compiled.save", inputs=(),
                                  outputs=(), saves=tuple(s.spec.name for s in ev[1])))
    ops.append(TapeOp(name="compiled.forward.end", kind="compiled", inputs=(), outputs=(),
                      releases=tuple(dict.fromkeys(s.spec.name for s in returned_fwd))))
    # -- the backward as grad nodes
    nodes: list[GradNode] = []
    for graph, events in bwd:
        steps: list[dict] = []
        flops = [0]  # of the node being built

        def flush(graph=graph):
            if steps or flops[0]:
                nodes.append(GradNode(name=f"compiled.backward.g{graph}.{len(nodes)}", op=None, flops=flops[0],
                                      steps=tuple(GradStep(tuple(x["allocs"]), tuple(x["frees"]), tuple(x["grads"]))
                                                  for x in steps)))
                steps.clear()
                flops[0] = 0

        for ev in events:
            if ev[0] == "flops":
                flops[0] += ev[1]
                continue
            if ev[0] == "accum":  # the engine's AccumulateGrad: `.grad` a copy of the parameter's layout
                steps.append({"allocs": [], "frees": [ev[2].spec.name], "grads": [ev[1]]})
                continue
            if ev[0] == "release":
                flush()
                nodes.append(GradNode(name=f"compiled.backward.g{graph}.release{marker[id(ev[1])]}",
                                      op=marker[id(ev[1])], steps=(GradStep(release_saved=True),)))
                continue
            s = ev[1]
            if ev[0] == "alloc":
                if not steps or steps[-1]["frees"]:
                    steps.append({"allocs": [], "frees": [], "grads": []})
                p = grad_param.get(id(s))
                (steps[-1]["grads"] if p else steps[-1]["allocs"]).append(p or s.spec)
            elif id(s) not in grad_param and s.born != "forward":
                if not steps:
                    steps.append({"allocs": [], "frees": [], "grads": []})
                steps[-1]["frees"].append(s.spec.name)
        flush()
    # what the caller holds, in the order the forward made it (`cap.held` is a set of storage keys: addresses)
    caller = {id(of_key[k]) for k in cap.held if k in of_key and of_key[k].born == "forward"}
    held = tuple(dict.fromkeys(s.spec.name for s in storages if id(s) in caller))
    trained = set(cap.grads)
    return Tape(params=[ParamSpec(n, shape) for n, shape, _, _ in cap.param_specs],
                ops=ops, inputs=[_spec(name, *cap.storages[k]) for k, name in cap.inputs.items()],
                buffers=[replace(_spec(name, *cap.storages[k]), requires_grad=False)
                         for k, name in cap.buffers.items() if k in cap.storages],
                held=held, backward=tuple(nodes), layers=cap.layers, buffers_follow_params=False,
                describer=describer, gradless=tuple(n for n, _, _, _ in cap.param_specs if n not in trained),
                param_dtypes={n: dt for n, _, dt, _ in cap.param_specs if dt != setup.precision.param},
                ties=cap.ties)
