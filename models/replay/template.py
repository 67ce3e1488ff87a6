"""Micro-batch templates: a replay's passes repeated from a recording instead of derived again.

Every micro-batch of a tape replays the same ops. A pass of the replay (forward.py `forward`, or the package's
`backward`: models/replay/__init__.py) is a function of four things only:
- its plan: the tape, the trainable set and the external tensors' specs (the plan's key, `GraphBuilder.replay_plans`);
- the replay's own state when the pass starts (state.py `ReplayState`: live blocks, reasons, gradients, saves,
  ...: `STATE` names the fields);
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

from ...simulator.events import Block, Stream

STATE = ("live", "reasons", "grad_of", "saved_at", "contributed", "grad_seen", "grad_buffer", "grad_had",
         "after_node", "autocast_cache", "view_pieces", "cache_pending")  # the ReplayState fields a pass changes


def pure_hooks(engine, state) -> bool:
    """Whether `engine`'s replay hooks (before_op, after_op, param_grad) act on nothing but the op, the replay's
    `state` and its GradState. Asked of the engine's class itself (never inherited: a subclass that overrides a hook
    must say so again, and a wrapper reaching its inner engine through __getattr__ is not answered for by the inner
    one)."""
    own = type(engine).__dict__.get("pure_replay_hooks")
    return own is not None and own(engine, state)


class _Unnamed(Exception):
    """A block or op a recording cannot name."""


class _Template:
    """One plan's recordings: its forward pass, and its backward passes by the state each starts from. It keeps the
    tape and trainable set it was made for (the plan's key names them by id, as the plan cache does: `matches`)."""

    def __init__(self, state, forward: tuple | None, end: tuple | None) -> None:
        self.tape, self.trainable = state.tape, state.trainable
        self.forward, self.end = forward, end  # None: the forward pass cannot be recorded
        self.backward: dict[tuple, tuple | None] = {}  # start -> (actions, end state, .grad changes); None: never

    def matches(self, state) -> bool:
        return self.tape is state.tape and self.trainable is state.trainable


def forward(state, run) -> None:
    """The replay's forward pass (`run(state)`, the real one): played from its plan's recording, or run (and
    recorded when it is the plan's first)."""
    builder = state.builder
    templates = builder.__dict__.get("replay_templates")
    key = state.plan_key
    if templates is None or key is None or state.tape.backward or not pure_hooks(builder.engine, state):
        run(state)
        return
    tab = [blk for _, blk in state.external.values()]
    template = templates.get(key)
    if template is not None and template.matches(state):
        if template.forward is None:  # never recordable
            run(state)
            return
        builder.play(template.forward, tab, state.step, state.mb)
        _restore(state, template.end, tab)
        state.template, state.tab = template, tab
        return
    rec = _Recorder(builder, state, tab)
    with rec:
        run(state)
    try:
        if not rec.ok:
            raise _Unnamed
        end = _capture(state, rec.index)
    except _Unnamed:
        templates[key] = _Template(state, None, None)
        return
    templates[key] = state.template = _Template(state, builder.recorded(rec.actions), end)
    state.tab, state.tab_index = tab, rec.index


def backward(state, run) -> None:
    """The replay's backward pass (`run(state)`, the real one): played when its forward was (or was recorded) and it
    starts from a state a backward of the plan was recorded from; otherwise run, and recorded."""
    template = state.template
    if template is None:
        run(state)
        return
    builder, tab = state.builder, state.tab
    index = state.tab_index or {blk.id: j for j, blk in enumerate(tab)}
    try:
        start = _start(state, tab, index)
    except _Unnamed:
        run(state)
        return
    recorded = template.backward.get(start, False)
    if recorded:
        actions, end, grads = recorded
        builder.play(actions, tab, state.step, state.mb)
        _restore(state, end, tab)
        blocks = state.grads.blocks
        for p, j in grads:
            blocks[p] = tab[j]
        return
    if recorded is None:
        run(state)
        return
    before = dict(state.grads.blocks)
    rec = _Recorder(builder, state, tab, index)
    with rec:
        run(state)
    try:
        if not rec.ok:
            raise _Unnamed
        after = state.grads.blocks
        if any(p not in after for p in before):
            raise _Unnamed
        grads = tuple((p, rec.ref(blk)) for p, blk in after.items() if before.get(p) is not blk)
        template.backward[start] = (builder.recorded(rec.actions), _capture(state, rec.index), grads)
    except _Unnamed:
        template.backward[start] = None


def _start(state, tab: list, index: dict) -> tuple:
    """The state a backward starts from, its blocks named by position: the blocks it holds that no pass made (a
    gradient receive buffer, a parameter's `.grad`) are named where they are found, and added to `tab`."""
    found = []
    for name, storage in state.grad_of.items():
        if storage.block.id not in index:
            index[storage.block.id] = len(tab)
            tab.append(storage.block)
            found.append(("grad_of", name))
    blocks = state.grads.blocks
    held = []
    for p in state.plan.params:
        blk = blocks.get(p)
        held.append(blk is not None)
        if blk is not None and blk.id not in index:
            index[blk.id] = len(tab)
            tab.append(blk)
            found.append(("grads", p))
    return (tuple(found), tuple(held), state.grads.persistent, _capture(state, index))


def _capture(state, index: dict) -> tuple:
    """The replay's `STATE`, its blocks named by their place in the pass's table (`index`: block id -> place)."""
    if state.after_node:
        raise _Unnamed

    def ref(blk: Block) -> int:
        j = index.get(blk.id)
        if j is None:
            raise _Unnamed
        return j

    storages: dict[int, int] = {}
    made = []
    grad_of = []
    for name, s in state.grad_of.items():
        k = storages.get(id(s))
        if k is None:
            k = storages[id(s)] = len(made)
            made.append((type(s), ref(s.block), s.refs, s.pinned))
        grad_of.append((name, k))
    return (tuple((n, ref(blk)) for n, blk in state.live.items()), tuple(state.reasons.items()), tuple(made),
            tuple(grad_of), tuple(state.saved_at.items()), frozenset(state.contributed),
            tuple(state.grad_seen.items()), tuple((p, ref(blk)) for p, blk in state.grad_buffer.items()),
            tuple(state.grad_had.items()), tuple(state.autocast_cache),
            tuple((n, tuple(ref(blk) for blk in pieces)) for n, pieces in state.view_pieces.items()),
            tuple((r, frozenset(names)) for r, names in state.cache_pending.items()))


def _restore(state, captured: tuple, tab: list) -> None:
    """Set the replay's `STATE` to a captured one, its blocks taken from `tab`."""
    live, reasons, made, grad_of, saved_at, contributed, seen, buffer, had, cache, views, pending = captured
    state.live = {n: tab[j] for n, j in live}
    state.reasons = dict(reasons)
    storages = [cls(tab[j], refs, pinned) for cls, j, refs, pinned in made]
    state.grad_of = {n: storages[k] for n, k in grad_of}
    state.saved_at = dict(saved_at)
    state.contributed = set(contributed)
    state.grad_seen = dict(seen)
    state.grad_buffer = {p: tab[j] for p, j in buffer}
    state.grad_had = dict(had)
    state.after_node = []
    state.autocast_cache = list(cache)
    state.view_pieces = {n: [tab[j] for j in pieces] for n, pieces in views}
    state.cache_pending = {r: set(names) for r, names in pending}


class _Recorder:
    """Records a pass as it runs: the builder's `block` and `op` are its own meanwhile (instance attributes over
    the class's methods), each block made named by its place in `tab`, each op by its place among the pass's
    (`state`: the replay's, for its step and micro-batch)."""

    def __init__(self, builder, state, tab: list, index: dict | None = None) -> None:
        self.builder, self.state, self.tab = builder, state, tab
        self.index = index if index is not None else {blk.id: j for j, blk in enumerate(tab)}
        self.actions: list = []
        self.ops: dict[int, int] = {}
        self.ok = True
        self.inside = False  # in the builder's op: a block it makes (the cuBLAS workspace) is the builder's own

    def __enter__(self):
        self.builder.block, self.builder.op = self.block, self.op
        return self

    def __exit__(self, *exc) -> None:
        del self.builder.block, self.builder.op

    def ref(self, blk: Block) -> int:
        j = self.index.get(blk.id)
        if j is None:
            raise _Unnamed
        return j

    def block(self, *args, **kw) -> Block:
        blk = type(self.builder).block(self.builder, *args, **kw)
        if not self.inside:
            self.index[blk.id] = len(self.tab)
            self.tab.append(blk)
            self.actions.append(blk)
        return blk

    def op(self, name, phase, step, micro_batch, allocs, frees, flops=0, bytes_moved=0, recompute=False,
           stream=Stream.COMPUTE, duration=None, after=(), gemm="cublas"):
        index = self.index
        try:
            if step != self.state.step or micro_batch != self.state.mb:
                raise _Unnamed
            a = tuple(self.ref(blk) for blk in allocs)
            f = tuple(index[i] for i in frees)
            deps = tuple(self.ops[d] for d in after if d is not None)
        except (_Unnamed, KeyError):
            self.ok = False
            a = f = deps = ()
        self.inside = True
        try:
            op = type(self.builder).op(self.builder, name, phase, step, micro_batch, allocs, frees, flops,
                                       bytes_moved, recompute, stream, duration, after, gemm)
        finally:
            self.inside = False
        self.ops[op.id] = len(self.ops)
        self.actions.append((op, a, f, deps, gemm))
        return op
