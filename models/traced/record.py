"""Record one micro-batch of training on fake tensors: every aten op, every storage's birth and death,
what autograd saves, and the backward the real autograd engine runs, node by node.

The model, the batch and the loss run for real, under torch's `FakeTensorMode` (shapes and dtypes, no
memory), with the project's tracker technique (traces/tracker/allocation.py): a `TorchDispatchMode` sees each
aten op below autograd, a new output storage is an allocation, `weakref.finalize` on the storage is
its free. On top of that:
- the module path an op runs in (global module forward hooks);
- what each autograd node saves: a `saved_tensors_hooks` pack hook wraps each saved tensor in a token,
  and after the forward pass every node of the graph is visited and its `_saved_*` attributes read,
  which unpacks the tokens (so each save is tied to the node that holds it, exactly);
- which forward op made which node (the grad_fn of the op's outputs, read at the next op);
- the backward: a pre-hook on every node marks where it starts; every allocation and free until the
  next node starts is that node's (its temporaries, the gradients it makes, the input-buffer sums
  after it, the saved tensors it releases);
- which backward storage became which parameter's `.grad`, and what the caller holds past backward.

The loop recorded is the documented one: `out = model(batch); loss = loss_fn(out); loss.backward();
del out, loss` (under `torch.autocast` for the forward and the loss when asked). realpath.py keeps the fake
run on the real run's path (integer values, transformers' tracing test, CPU kernels' fake rules).
The dispatch mode itself, and what it names and counts (dtypes, FLOPs), is recorder.py's `Recorder`; this
module runs the loop under it and reads the graph.
"""

from __future__ import annotations

import weakref

import torch

from .realpath import INPLACE_KEY, cpu_fake_kernels, fresh_caches, real_code_paths, tensors_in
from .recorder import DTYPES, OP_KEY, FlopCount, Recorder, op_flops, storage_lookup
from .recording import BackwardNode, Recording

__all__ = ["record", "find_layers",
           "DTYPES", "op_flops", "FlopCount", "storage_lookup"]  # recorder.py's, read from here too


class _Token:
    """What the pack hook returns: the saved tensor's storage id, and a detached alias to hand back; `op`: how
    many forward ops were recorded when it was saved (a node's inputs are saved before its op is recorded, its
    outputs after)."""

    __slots__ = ("sid", "tensor", "op", "__weakref__")

    def __init__(self, sid: int | None, tensor: torch.Tensor, op: int = -1) -> None:
        self.sid = sid
        self.tensor = tensor
        self.op = op



def find_layers(model: torch.nn.Module) -> tuple[str, ...]:
    """The repeated blocks of a model: the entries of each `nn.ModuleList` (else `nn.Sequential`) of two or
    more modules of one class that hold parameters, outermost lists only, in registration order."""
    for kind in (torch.nn.ModuleList, torch.nn.Sequential):
        found: list[str] = []
        for name, m in model.named_modules():
            if not isinstance(m, kind) or len(m) < 2 or any(name.startswith(f + ".") for f in found):
                continue
            children = list(m.named_children())
            if len({type(c) for _, c in children}) == 1 and all(any(True for _ in c.parameters()) for _, c in children):
                found += [f"{name}.{n}" if name else n for n, _ in children]
        if found:
            return tuple(found)
    return ()


def _graph_nodes(*roots) -> list:
    """Every node reachable from `roots`, in a stable (depth-first, first-seen) order."""
    seen: dict[int, object] = {}
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(n for n, _ in reversed(node.next_functions))
    return list(seen.values())


def record(model: torch.nn.Module, batch, loss_fn, autocast: torch.dtype | None = None,
           values: dict | None = None, program=None) -> Recording:
    """Run one micro-batch of `model` (built under a FakeTensorMode that is active now) and record it.
    `values` maps batch tensors (fake) to their real values (see `Shadows`). `loss_fn` None: a forward pass
    only (`out = model(batch)`, autograd on): the graph's saves are recorded, no backward runs, and `del out`
    frees them (models/config.py PASSES). `program`: a context the whole run (recomputation included) goes
    through, e.g. cuda_program.py's, which makes it the CUDA program; None: the CPU program. The tensors the
    model's forward memoises are computed anew and forgotten after (realpath.py `fresh_caches`: after the
    recording's finalizers are detached, so what a cache held is alive at the end, as in the real run)."""
    with fresh_caches(model):
        return _record(model, batch, loss_fn, autocast, values, program)


def _record(model, batch, loss_fn, autocast, values, program) -> Recording:
    rec = Recorder(model)
    rec.temporaries = getattr(program, "temporaries", None)
    rec.real_branches = getattr(program, "real_tensor_branches", False)
    cache = getattr(program, "cache", None)
    if cache is not None:  # the program's autocast weight cache says which casts it holds (cuda_program.py)
        cache.on_cached = lambda t: rec.autocast_cached.append(rec.storage_of(t))
    for fake, real in (values or {}).items():
        rec.shadows.add(fake, real)
    names = {id(m): n or "model" for n, m in model.named_modules()}
    params = []
    for n, p in model.named_parameters():
        sid = rec.see(p, "param", n)
        if sid is not None:
            rec.param_of[sid] = n
        params.append((n, tuple(p.shape), DTYPES.get(p.dtype, str(p.dtype)), p.requires_grad))
    buffers = []
    for n, b in model.named_buffers():
        sid = rec.see(b, "buffer", n)
        if sid is not None:
            buffers.append(rec.storages[sid])
    inputs = []
    for k, t in enumerate(tensors_in(batch)):
        sid = rec.see(t, "input", f"batch.{k}")
        if sid is not None and rec.storages[sid] not in inputs:
            inputs.append(rec.storages[sid])

    def pre(module, args):
        # a module outside the model's tree (one made on the fly, as transformers' hub-kernel function
        # wrappers are) runs in the module that called it: its ops keep that path (layers, FSDP units)
        rec.module_stack.append(names.get(id(module)) or (rec.module_stack[-1] if rec.module_stack else "model"))

    def post(module, args, output):
        if rec.module_stack:
            rec.module_stack.pop()

    tokens = weakref.WeakSet()  # every save still held (by a node of the graph, or by a node hidden in another)
    claimed: set[int] = set()  # the saves read back from the graph's nodes

    def pack(t: torch.Tensor) -> _Token:
        token = _Token(rec.storage_of(t), t.detach(), len(rec.ops))
        tokens.add(token)
        return token

    unpacked: list[int] = []

    def unpack(token: _Token) -> torch.Tensor:
        claimed.add(id(token))
        if token.sid is not None:
            unpacked.append(token.sid)
        return token.tensor

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
             torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
    try:
        with cpu_fake_kernels(), real_code_paths(), program or _null(), rec, \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            rec.phase = "forward"
            ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else _null()
            with ctx:
                try:
                    out = _call(model, batch)
                    loss = loss_fn(out) if loss_fn is not None else None
                except Exception as e:
                    e.peakledger_where = rec.last_where
                    raise
            rec._resolve_pending()
            rec._resolve_replays()
            rec.phase = "graph"
            if loss_fn is None:
                graph = _graph_nodes(*(t.grad_fn for t in tensors_in(out) if t.grad_fn is not None))
            elif not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
                raise TypeError("loss_fn(output) must return a scalar tensor that requires grad")
            else:
                graph = _graph_nodes(loss.grad_fn)
            saves: dict[int, list[int]] = {}
            for node in graph:
                unpacked.clear()
                for attr in dir(node):
                    if attr.startswith("_saved_"):
                        try:
                            getattr(node, attr)
                        except RuntimeError:
                            pass
                saves[id(node)] = list(unpacked)
            # a CopySlices node (an in-place write on a view) holds the node of the op it wraps, whose saves no
            # `_saved_*` attribute shows (the in-place ReLU's result): they are its own (view_replays)
            hidden = [(t.sid, t.op) for t in tokens if id(t) not in claimed and t.sid is not None]
            for node in graph:
                window = node.metadata.get(INPLACE_KEY)
                if window is not None:
                    saves[id(node)] += [sid for sid, op in hidden if window[0] <= op <= window[1]]
            order: list = []

            def start(node):
                def hook(grad_outputs):
                    rec.current_index = rec.node_index[id(node)]
                    rec.current = rec.nodes[rec.current_index]
                    rec.node_inputs = {rec.storage_of(g) for g in grad_outputs if isinstance(g, torch.Tensor)}
                    order.append(id(node))
                return hook

            node_hooks = []
            for node in graph:
                rec.node_index[id(node)] = len(rec.nodes)
                op = node.metadata.get(OP_KEY)
                where = rec.ops[op].module if op is not None else "model"
                label = node.name().split("::")[-1]
                if hasattr(node, "variable"):
                    label = f"{rec.param_of.get(rec.storage_of(node.variable), 'param')}.{label}"
                else:
                    label = f"{where}.{label}"
                rec.nodes.append(BackwardNode(label, op, saves=[s for s in saves[id(node)]
                                                                 if s not in rec.param_of]))
                node_hooks.append(node.register_prehook(start(node)))
            graph = None
            seed = BackwardNode("loss.grad_seed", None)  # backward()'s ones_like, before any node runs
            rec.current, rec.current_index = seed, -1
            rec.phase = "backward"
            if loss is not None:
                loss.backward()
            else:  # forward only: no node runs; every node of the graph stands for the saves it holds
                order = [k for k in rec.node_index]
            rec.current = None
            for h in node_hooks:
                h.remove()
            node_hooks = None
            rec.phase = "after"
            param_grads = {}
            for n, p in model.named_parameters():
                if p.grad is not None:
                    sid = rec.storage_of(p.grad)
                    if sid is not None:
                        param_grads[sid] = n
            held = [sid for sid, s in rec.storages.items() if s.born == "forward" and s.death is None]
            rec.phase = "end"
            del out, loss
    finally:
        for h in hooks:
            h.remove()
    nodes = ([seed] if loss_fn is not None else []) + [rec.nodes[rec.node_index[k]] for k in order]
    # a death in backward was noted by the index the node got when the graph was walked: now its place in `nodes`
    place = {rec.node_index[k]: i for i, k in enumerate(order, start=1 if loss_fn is not None else 0)}
    place[-1] = 0  # the grad seed
    for s in rec.storages.values():
        if s.death is not None and s.death[0] == "backward":
            s.death = ("backward", place.get(s.death[1], s.death[1]))
    for f in rec.finalizers:
        f.detach()
    return Recording(params, buffers, inputs, rec.storages, rec.ops, nodes, param_grads,
                     [h for h in held if rec.storages[h].death is not None], list(names.values()),
                     find_layers(model), type(model).__name__,
                     tuple(sorted({sid for sid in rec.autocast_cached if sid is not None})))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _call(model, batch):
    """dict -> model(**batch), tuple/list -> model(*batch), tensor -> model(batch)."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
