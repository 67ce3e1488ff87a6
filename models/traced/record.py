"""Record one micro-batch of training on fake tensors: every aten op, every storage's birth and death,
what autograd saves, and the backward the real autograd engine runs, node by node.

The model, the batch and the loss run for real, under torch's `FakeTensorMode` (shapes and dtypes, no
memory), with the project's tracker technique (traces/tracker.py): a `TorchDispatchMode` sees each
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
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .kernel_outputs import real_outputs
from .real_branches import buffer_branch, formula_branch
from .realpath import (
    INPLACE_KEY,
    SCALAR_READS,
    Shadows,
    cpu_fake_kernels,
    fresh_caches,
    real_code_paths,
    tensors_in,
    view_replays,
)
from .recording import BackwardNode, ForwardOp, Recording, Storage

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "int64",
          torch.int32: "int32", torch.bool: "bool", torch.int8: "int8", torch.uint8: "uint8",
          torch.float64: "fp64", torch.int16: "int16", torch.complex64: "complex64",
          torch.uint64: "int64"}  # uint64: the philox seed / offset of CUDA SDPA kernels (8 bytes, as int64)


def op_flops(func, args, kwargs, out) -> int:
    """torch's own FLOP formulas (torch/utils/flop_counter.py), for the ops it knows (matmuls, attention, conv)."""
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **(kwargs or {}), out_val=out))
    except Exception:  # a formula that does not take this overload's arguments: no FLOPs counted
        return 0


class FlopCount(TorchDispatchMode):
    """While active, the FLOPs of every op that runs (`op_flops`), in `total`: torch's FlopCounterMode without
    its module tracking (global module hooks, which eager checkpointing's recompute trips over)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += op_flops(func, args, kwargs, out)
        return out


OP_KEY = "peakledger_op"  # a node's metadata key: the index of the forward op that made it


class _Token:
    """What the pack hook returns: the saved tensor's storage id, and a detached alias to hand back; `op`: how
    many forward ops were recorded when it was saved (a node's inputs are saved before its op is recorded, its
    outputs after)."""

    __slots__ = ("sid", "tensor", "op", "__weakref__")

    def __init__(self, sid: int | None, tensor: torch.Tensor, op: int = -1) -> None:
        self.sid = sid
        self.tensor = tensor
        self.op = op


def storage_lookup(live: dict, t: torch.Tensor):
    """(`t`'s untyped storage or None, the id it was recorded under or None): `live` maps id(storage) to
    (recorded id, a weak reference to the storage), as the recorders here and in models/script keep it."""
    try:
        st = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None, None
    hit = live.get(id(st))
    return st, (hit[0] if hit is not None and hit[1]() is st else None)


class Recorder(TorchDispatchMode):
    """Use through `record(...)`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.storages: dict[int, Storage] = {}
        self.live: dict[int, tuple[int, weakref.ref]] = {}  # id(storage object) -> (storage id, ref)
        self.param_of: dict[int, str] = {}  # storage id -> parameter name
        self.ops: list[ForwardOp] = []
        self.nodes: list[BackwardNode] = []
        self.phase = "setup"
        self.node_index: dict[int, int] = {}  # id(node) -> index in self.nodes (backward)
        self.current: BackwardNode | None = None
        self.current_index = -1
        self.resolving = False
        self.pending: tuple[int, list[weakref.ref]] | None = None
        self.module_stack: list[str] = []
        self.finalizers: list[weakref.finalize] = []
        self.shadows = Shadows()
        self.replays = view_replays()  # views written in place: their backward as the real engine builds it
        self.last_where = "model"  # the module of the latest op (named when the model fails)
        # the program's kernels' own temporaries of an aten call (cuda_program.py), or None: the CPU's, not shown
        self.temporaries = None
        # autograd's real-tensor branches (real_branches.py): the CUDA program's; the CPU program is measured
        # under the tracker's dispatch mode, under which torch takes the subclass branches too
        self.real_branches = False
        self.node_inputs: set = set()  # storages of the gradients the running backward node was given
        self.autocast_cached: list = []  # storages of the casts the program's autocast cache holds

    # -- storages -----------------------------------------------------------------------------------
    def storage_of(self, t: torch.Tensor) -> int | None:
        return storage_lookup(self.live, t)[1]

    def see(self, t: torch.Tensor, born: str, name: str, op: int = -1) -> int | None:
        """The storage id of `t`, recording its storage as allocated now if it is new."""
        st, known = storage_lookup(self.live, t)
        if st is None or known is not None:
            return known
        if st.nbytes() == 0:
            return None
        sid = len(self.storages) + 1
        self.storages[sid] = Storage(sid, st.nbytes(), DTYPES.get(t.dtype, str(t.dtype).replace("torch.", "")),
                                     tuple(t.shape), name, born, op, bool(t.requires_grad))
        self.live[id(st)] = (sid, weakref.ref(st))
        self.finalizers.append(weakref.finalize(st, self._freed, id(st), sid))
        if born == "backward" and self.current is not None:
            self.current.events.append(("alloc", sid))
        return sid

    def _freed(self, key: int, sid: int) -> None:
        hit = self.live.get(key)
        if hit is not None and hit[0] == sid:
            del self.live[key]
        s = self.storages[sid]
        if s.death is not None:
            return
        if self.phase == "forward":
            s.death = ("forward", len(self.ops) - 1)
        elif self.phase == "backward" and self.current is not None:
            s.death = ("backward", self.current_index)
            self.current.events.append(("free", sid))
        else:
            s.death = (self.phase, 0)

    # -- dispatch -----------------------------------------------------------------------------------
    def _resolve_pending(self) -> None:
        if self.pending is None:
            return
        i, refs = self.pending
        self.pending = None
        self.resolving = True  # reading a view's grad_fn after an in-place op regenerates it: ops not to record
        try:
            for ref in refs:
                t = ref()
                # a view's grad_fn is regenerated from its base after an in-place op: not read (the op that made
                # the view allocated nothing; its node keeps its own events, unmapped)
                node = getattr(t, "grad_fn", None) if t is not None and not t._is_view() else None
                # the op index goes on the node itself (its metadata dict): holding the node, or keying by its
                # id, would keep alive what the real run frees (the saves of an output no loss reads, CLIP's
                # pooler) or mistake a new node for a dead one at the same address
                if node is not None and OP_KEY not in node.metadata:
                    node.metadata[OP_KEY] = i
        finally:
            self.resolving = False

    def _resolve_replays(self) -> None:
        self.resolving = True
        try:
            self.replays.resolve(len(self.ops))
        finally:
            self.resolving = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "prim" or self.resolving:  # metadata queries; autograd's own view replays
            return func(*args, **(kwargs or {}))
        self.last_where = self._where()
        real = self.shadows.inputs(func, args, kwargs)
        if func in SCALAR_READS:  # a Python branch on a value: the real one where the shadows know it
            answer = self.shadows.read(func, args, kwargs, real)
            if answer is not None:
                return answer
        if self.replays.pending and not func.is_view:  # not inside autograd's replay of a view (it holds the
            self._resolve_replays()                    # view's lock while it dispatches the view ops again)
        self._resolve_pending()
        ins = tensors_in((args, kwargs))
        in_ids = {}
        new = []  # forward: storages this op allocates (and tensors made outside dispatch it is the first to read)
        for t in ins:
            sid = self.storage_of(t)
            if sid is None and self.phase in ("forward", "backward"):
                sid = self.see(t, self.phase, f"{self._where()}.untracked.{len(self.ops)}", op=len(self.ops))
                if sid is not None and self.phase == "forward":
                    new.append(sid)
                    continue
            if sid is not None:
                in_ids[sid] = None
        if self.real_branches and self.phase == "backward" and self.current is not None:
            func = formula_branch(func, args, self._made_in_node)
            func = buffer_branch(func, args, kwargs, self._waiting, self._fresh)
        known = self.shadows.known_shape(func, args, kwargs, real)
        if known is not None and known[0] == "out":  # an output shape the values it depends on decide
            out = known[1]
        else:
            call, call_args, call_kwargs = known[1:] if known is not None else (func, args, kwargs)
            out = real_outputs(func, args, kwargs, call(*call_args, **(call_kwargs or {})))
            self.shadows.follow(func, args, kwargs, real, out)
        short = str(func).replace("aten.", "").replace(".default", "")
        outs = tensors_in(out)
        flops = op_flops(func, args, kwargs, out)
        temps = self.temporaries(func, args, kwargs, out) if self.temporaries is not None else ()
        if self.phase == "forward":
            i = len(self.ops)
            for k, t in enumerate(outs):
                sid = self.storage_of(t)
                if sid is None:
                    sid = self.see(t, "forward", f"{self._where()}.{short}.{i}" + (f".out{k}" if k else ""), op=i)
                    if sid is not None:
                        new.append(sid)
            new += self._temporaries(temps, f"{self._where()}.{short}.{i}", i)
            reads = tuple(s for s in in_ids if s not in self.param_of)
            params = tuple(dict.fromkeys(self.param_of[s] for s in in_ids if s in self.param_of))
            self.ops.append(ForwardOp(f"{self._where()}.{short}", short, self._where(), reads, params, tuple(new),
                                      flops))
            self.pending = (i, [weakref.ref(t) for t in outs])
            self.replays.note(func, args, i)
        elif self.phase == "backward":
            where = self.current.name if self.current is not None else "backward"
            if self.current is not None:
                self.current.flops += flops
            for t in outs:
                if self.storage_of(t) is None:
                    self.see(t, "backward", f"{where}.{short}")
            self._temporaries(temps, f"{where}.{short}", -1)
        return out

    def _made_in_node(self, t: torch.Tensor) -> bool:
        """`t`'s storage was allocated by the backward node running now."""
        sid = self.storage_of(t)
        return sid is not None and ("alloc", sid) in self.current.events

    def _waiting(self, t: torch.Tensor) -> bool:
        """`t` is a gradient an earlier backward node made."""
        sid = self.storage_of(t)
        return sid is not None and self.storages[sid].born == "backward" and ("alloc", sid) not in self.current.events

    def _fresh(self, t: torch.Tensor) -> bool:
        """`t` was made by the running backward node, or given to it."""
        return self._made_in_node(t) or self.storage_of(t) in self.node_inputs

    def _temporaries(self, temps, name: str, op: int) -> list[int]:
        """Storages a kernel allocates and frees inside itself after its outputs (`temporaries`, e.g. a CUDA
        reduction's staging buffer: (bytes, role, the rule's arguments) each), last made first freed: born and dead in
        this op (forward) or node."""
        sids = []
        for nbytes, role, rule in temps:
            sid = len(self.storages) + 1
            born = "forward" if self.phase == "forward" else "backward"
            self.storages[sid] = Storage(sid, nbytes, "uint8", (nbytes,), f"{name}.{role}", born, op,
                                         death=("forward", op) if born == "forward" else None, rule=(role, *rule))
            if born == "backward" and self.current is not None:
                self.current.events.append(("alloc", sid))
            sids.append(sid)
        if self.phase != "forward" and self.current is not None:
            for sid in reversed(sids):
                self.storages[sid].death = ("backward", self.current_index)
                self.current.events.append(("free", sid))
        return sids

    def _where(self) -> str:
        return self.module_stack[-1] if self.module_stack else "model"


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
