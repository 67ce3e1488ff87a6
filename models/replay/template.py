"""Micro-batch templates: a replay's passes repeated from a recording instead of derived again.

Every micro-batch of a tape replays the same ops. A pass of the replay (models/autograd.py `MicroBatchReplay`: its
forward, or its backward) is a function of four things only:
- its plan: the tape, the trainable set and the external tensors' specs (the plan's key, `GraphBuilder.replay_plans`);
- the replay's own state when the pass starts (live blocks, reasons, gradients, saves, ...: `STATE`);
- which of the tape's parameters hold a `.grad` (`GradState`), read and written by the engine's `param_grad`;
- the engine's hooks, when they act on nothing else (`pure_hooks`: an engine says so for itself, in its class's own
  `pure_replay_hooks`; the single-device engine, DDP, ZeroRedundancyOptimizer and DeepSpeed ZeRO-0/1 do, and tensor
  and pipeline parallelism around them, unless the pipeline schedule runs code of its own inside the forward).
Under those conditions what a pass does is fixed by them: the blocks it makes (the same fields but the id, which
comes from the builder's counter in the same order), the ops it emits through the builder (the same arguments, its
blocks named by their place among the pass's), the state and gradients it leaves.

So the first replay of a plan records its forward pass (`_Recorder`: every block made and every op emitted, in
order, and the state it leaves, its blocks named by position), and each backward pass by the state it starts from
(the replay's, named the same way, plus which parameters hold a `.grad`): a micro-batch whose parameters have no
`.grad` yet starts from another state than one accumulating into them, and gets a recording of its own. A later
replay of the plan plays the forward (`GraphBuilder.play`: the same blocks with fresh ids, the same ops through the
builder, which still adds what depends on the rank's history, the stream order and the cuBLAS (and cuBLASLt) workspace
of a thread's first GEMM) and takes on the recorded state; its backward is played when it starts from a recorded state,
and otherwise runs and is recorded. A pass a recording cannot name (a block or op that is neither the pass's nor one
of the state's, an op of another step or micro-batch) is never recorded: that plan's pass always runs.
"""

from __future__ import annotations

from ..simulator.events import Block, Stream

STATE = ("live", "reasons", "grad_of", "saved_at", "contributed", "grad_seen", "grad_buffer", "grad_had",
         "after_node", "autocast_cache", "view_pieces", "cache_pending")  # what a pass of the replay changes


def pure_hooks(engine, replay) -> bool:
    """Whether `engine`'s replay hooks (before_op, after_op, param_grad) act on nothing but the op, `replay` and its
    GradState. Asked of the engine's class itself (never inherited: a subclass that overrides a hook must say so
    again, and a wrapper reaching its inner engine through __getattr__ is not answered for by the inner one)."""
    own = type(engine).__dict__.get("pure_replay_hooks")
    return own is not None and own(engine, replay)


class _Unnamed(Exception):
    """A block or op a recording cannot name."""


class _Template:
    """One plan's recordings: its forward pass, and its backward passes by the state each starts from. It keeps the
    tape and trainable set it was made for (the plan's key names them by id, as the plan cache does: `matches`)."""

    def __init__(self, replay, forward: tuple | None, end: tuple | None) -> None:
        self.tape, self.trainable = replay.tape, replay.trainable
        self.forward, self.end = forward, end  # None: the forward pass cannot be recorded
        self.backward: dict[tuple, tuple | None] = {}  # start -> (actions, end state, .grad changes); None: never

    def matches(self, replay) -> bool:
        return self.tape is replay.tape and self.trainable is replay.trainable


def forward(replay, run) -> None:
    """The replay's forward pass (`run`, the real one): played from its plan's recording, or run (and recorded
    when it is the plan's first)."""
    b = replay.b
    templates = b.__dict__.get("replay_templates")
    key = replay.plan_key
    if templates is None or key is None or replay.tape.backward or not pure_hooks(b.engine, replay):
        run()
        return
    tab = [blk for _, blk in replay.external.values()]
    template = templates.get(key)
    if template is not None and template.matches(replay):
        if template.forward is None:  # never recordable
            run()
            return
        b.play(template.forward, tab, replay.step, replay.mb)
        _restore(replay, template.end, tab)
        replay.template, replay.tab = template, tab
        return
    rec = _Recorder(b, replay, tab)
    with rec:
        run()
    try:
        if not rec.ok:
            raise _Unnamed
        end = _capture(replay, rec.index)
    except _Unnamed:
        templates[key] = _Template(replay, None, None)
        return
    templates[key] = replay.template = _Template(replay, b.recorded(rec.actions), end)
    replay.tab, replay.tab_index = tab, rec.index


def backward(replay, run) -> None:
    """The replay's backward pass (`run`, the real one): played when its forward was (or was recorded) and it starts
    from a state a backward of the plan was recorded from; otherwise run, and recorded."""
    template = getattr(replay, "template", None)
    if template is None:
        run()
        return
    tab = replay.tab
    index = getattr(replay, "tab_index", None) or {blk.id: j for j, blk in enumerate(tab)}
    try:
        start = _start(replay, tab, index)
    except _Unnamed:
        run()
        return
    recorded = template.backward.get(start, False)
    if recorded:
        actions, end, grads = recorded
        replay.b.play(actions, tab, replay.step, replay.mb)
        _restore(replay, end, tab)
        blocks = replay.grads.blocks
        for p, j in grads:
            blocks[p] = tab[j]
        return
    if recorded is None:
        run()
        return
    before = dict(replay.grads.blocks)
    rec = _Recorder(replay.b, replay, tab, index)
    with rec:
        run()
    try:
        if not rec.ok:
            raise _Unnamed
        after = replay.grads.blocks
        if any(p not in after for p in before):
            raise _Unnamed
        grads = tuple((p, rec.ref(blk)) for p, blk in after.items() if before.get(p) is not blk)
        template.backward[start] = (replay.b.recorded(rec.actions), _capture(replay, rec.index), grads)
    except _Unnamed:
        template.backward[start] = None


def _start(replay, tab: list, index: dict) -> tuple:
    """The state a backward starts from, its blocks named by position: the blocks it holds that no pass made (a
    gradient receive buffer, a parameter's `.grad`) are named where they are found, and added to `tab`."""
    found = []
    for name, storage in replay.grad_of.items():
        if storage.block.id not in index:
            index[storage.block.id] = len(tab)
            tab.append(storage.block)
            found.append(("grad_of", name))
    blocks = replay.grads.blocks
    held = []
    for p in replay.plan_params:
        blk = blocks.get(p)
        held.append(blk is not None)
        if blk is not None and blk.id not in index:
            index[blk.id] = len(tab)
            tab.append(blk)
            found.append(("grads", p))
    return (tuple(found), tuple(held), replay.grads.persistent, _capture(replay, index))


def _capture(replay, index: dict) -> tuple:
    """The replay's `STATE`, its blocks named by their place in the pass's table (`index`: block id -> place)."""
    if replay.after_node:
        raise _Unnamed

    def ref(blk: Block) -> int:
        j = index.get(blk.id)
        if j is None:
            raise _Unnamed
        return j

    storages: dict[int, int] = {}
    made = []
    grad_of = []
    for name, s in replay.grad_of.items():
        k = storages.get(id(s))
        if k is None:
            k = storages[id(s)] = len(made)
            made.append((type(s), ref(s.block), s.refs, s.pinned))
        grad_of.append((name, k))
    return (tuple((n, ref(blk)) for n, blk in replay.live.items()), tuple(replay.reasons.items()), tuple(made),
            tuple(grad_of), tuple(replay.saved_at.items()), frozenset(replay.contributed),
            tuple(replay.grad_seen.items()), tuple((p, ref(blk)) for p, blk in replay.grad_buffer.items()),
            tuple(replay.grad_had.items()), tuple(replay.autocast_cache),
            tuple((n, tuple(ref(blk) for blk in pieces)) for n, pieces in replay.view_pieces.items()),
            tuple((r, frozenset(names)) for r, names in replay.cache_pending.items()))


def _restore(replay, state: tuple, tab: list) -> None:
    """Set the replay's `STATE` to a captured one, its blocks taken from `tab`."""
    live, reasons, made, grad_of, saved_at, contributed, seen, buffer, had, cache, views, pending = state
    replay.live = {n: tab[j] for n, j in live}
    replay.reasons = dict(reasons)
    storages = [cls(tab[j], refs, pinned) for cls, j, refs, pinned in made]
    replay.grad_of = {n: storages[k] for n, k in grad_of}
    replay.saved_at = dict(saved_at)
    replay.contributed = set(contributed)
    replay.grad_seen = dict(seen)
    replay.grad_buffer = {p: tab[j] for p, j in buffer}
    replay.grad_had = dict(had)
    replay.after_node = []
    replay.autocast_cache = list(cache)
    replay.view_pieces = {n: [tab[j] for j in pieces] for n, pieces in views}
    replay.cache_pending = {r: set(names) for r, names in pending}


class _Recorder:
    """Records a pass as it runs: the builder's `block` and `op` are its own meanwhile (instance attributes over
    the class's methods), each block made named by its place in `tab`, each op by its place among the pass's."""

    def __init__(self, b, replay, tab: list, index: dict | None = None) -> None:
        self.b, self.replay, self.tab = b, replay, tab
        self.index = index if index is not None else {blk.id: j for j, blk in enumerate(tab)}
        self.actions: list = []
        self.ops: dict[int, int] = {}
        self.ok = True
        self.inside = False  # in the builder's op: a block it makes (the cuBLAS workspace) is the builder's own

    def __enter__(self):
        self.b.block, self.b.op = self.block, self.op
        return self

    def __exit__(self, *exc) -> None:
        del self.b.block, self.b.op

    def ref(self, blk: Block) -> int:
        j = self.index.get(blk.id)
        if j is None:
            raise _Unnamed
        return j

    def block(self, *args, **kw) -> Block:
        blk = type(self.b).block(self.b, *args, **kw)
        if not self.inside:
            self.index[blk.id] = len(self.tab)
            self.tab.append(blk)
            self.actions.append(blk)
        return blk

    def op(self, name, phase, step, micro_batch, allocs, frees, flops=0, bytes_moved=0, recompute=False,
           stream=Stream.COMPUTE, duration=None, after=(), gemm="cublas"):
        index = self.index
        try:
            if step != self.replay.step or micro_batch != self.replay.mb:
                raise _Unnamed
            a = tuple(self.ref(blk) for blk in allocs)
            f = tuple(index[i] for i in frees)
            deps = tuple(self.ops[d] for d in after if d is not None)
        except (_Unnamed, KeyError):
            self.ok = False
            a = f = deps = ()
        self.inside = True
        try:
            op = type(self.b).op(self.b, name, phase, step, micro_batch, allocs, frees, flops, bytes_moved, recompute,
                                 stream, duration, after, gemm)
        finally:
            self.inside = False
        self.ops[op.id] = len(self.ops)
        self.actions.append((op, a, f, deps, gemm))
        return op
