"""What a trace records, as plain data (no torch objects): the storages, the forward ops, the autograd nodes.
record.py fills them in while the model runs on fake tensors; convert.py, depth.py and scale.py read them; the
disk cache (store.py) writes and reads them, so a cached recording is used without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Storage:
    """One allocation seen in the run."""

    id: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    name: str
    born: str  # "param", "buffer", "input", "forward", "backward", "grad" (a `.grad` at the start)
    op: int = -1  # the forward op that made it (born "forward")
    requires_grad: bool = False
    death: tuple[str, int] | None = None  # ("forward", op index) / ("backward", node index) / ("end", 0)
    # a kernel's own temporary whose size a GPU rule gives (cuda_program.py): (role, the rule's arguments), from which
    # scale.py computes it at another micro-batch; None for every other storage
    rule: tuple | None = None


@dataclass
class ForwardOp:
    name: str  # module path . aten op
    aten: str
    module: str
    reads: tuple[int, ...]  # storage ids read (not parameters)
    params: tuple[str, ...]  # parameter names read
    outputs: tuple[int, ...]  # storages it allocated
    flops: int = 0


@dataclass
class BackwardNode:
    name: str
    op: int | None  # the forward op that made it (None: AccumulateGrad and nodes no op returned)
    events: list[tuple[str, int]] = field(default_factory=list)  # ("alloc" | "free", storage id) in order
    saves: list[int] = field(default_factory=list)  # storage ids it saved (forward-born or batch)
    flops: int = 0


@dataclass
class Recording:
    params: list[tuple[str, tuple[int, ...], str, bool]]  # name, shape, dtype, requires_grad
    buffers: list[Storage]
    inputs: list[Storage]
    storages: dict[int, Storage]
    ops: list[ForwardOp]
    nodes: list[BackwardNode]
    param_grads: dict[int, str]  # backward storage -> the parameter whose `.grad` it became
    held: list[int]  # forward storages the caller held until after backward (freed by `del out, loss`)
    modules: list[str]  # every module path, in `named_modules` order
    layers: tuple[str, ...] = ()  # the repeated blocks (`find_layers`)
    model_class: str = ""
    autocast_cached: tuple[int, ...] = ()  # forward storages autocast's weight cache held until its region exited
