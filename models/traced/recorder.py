"""The dispatch mode that records one micro-batch on fake tensors (`Recorder`, run by record.py's `record`): each
aten op's new storages, what it reads, the parameters it uses and its FLOPs, the module it runs in; in backward,
what each autograd node allocates and frees; each storage's birth and death (`weakref.finalize`). With what it
names and counts: `DTYPES`, `op_flops` (and `FlopCount`, the FLOPs alone), `storage_lookup`."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .inplace_views import view_replays
from .kernel_outputs import real_outputs
from .real_branches import buffer_branch, formula_branch
from .recording import BackwardNode, ForwardOp, Storage
from .shadows import SCALAR_READS, Shadows, tensors_in

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
