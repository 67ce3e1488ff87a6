"""A recording (record.py) as the project's tape (models/tape.py), under a training setup's checkpointing.

- Forward ops that allocate nothing and made no autograd node (views, detach, metadata) are dropped:
  a view's reads are its base storage's, and later ops read that storage themselves.
- Each storage is one tensor, named after the module and aten op that made it; its shape is the
  op's output shape (or its bytes as a flat tensor where the storage is larger than the view).
- What each node saved becomes its forward op's `saves` (one entry per saved variable); a tensor the
  code keeps past its last read goes in `releases` of the op after which it really went; forward
  tensors alive after backward are `held` (the model output the caller keeps: logits, a KV cache).
- The backward is the recorded node order; a node's events become `GradStep`s: a run of allocations
  followed by a run of frees. The storage that became a parameter's `.grad` is not allocated by the
  step: the step names the parameter (`grads`) and the replay's engine makes the gradient, so
  accumulation and sharding work as for the hand-written tapes. The node's saved tensors are released
  where its first forward-born tensor was freed (else after its last step).
- Checkpointing: `layers` are the model's repeated blocks (found by `find_layers`); an op whose module
  path lies in layer j gets the region of j's segment (models/tape.py `checkpoint_segments`).
"""

from __future__ import annotations

import dataclasses
from math import prod

from ..config import ConfigError, TrainingSetup, dtype_bytes
from ..tape import SAC_SAVED_ATEN, GradNode, GradStep, ParamSpec, Tape, TapeOp, TensorSpec, checkpoint_segments
from .recording import Recording, Storage

SAC_KEPT = frozenset(SAC_SAVED_ATEN)  # aten ops whose outputs op-policy keeps (models/tape.py `op_policy`)
POLICIES = ("none", "full", "every-k", "layers", "sqrt", "op-policy", "offload")


def _spec(s: Storage, name: str) -> TensorSpec:
    size = dtype_bytes(s.dtype) if _known(s.dtype) else 1
    if _known(s.dtype) and prod(s.shape) * size == s.nbytes:
        return TensorSpec(name, s.shape, s.dtype, s.requires_grad)
    if _known(s.dtype) and s.nbytes % size == 0:
        return TensorSpec(name, (s.nbytes // size,), s.dtype, s.requires_grad)
    return TensorSpec(name, (s.nbytes,), "int8", s.requires_grad)


def _known(dtype: str) -> bool:
    try:
        dtype_bytes(dtype)
        return True
    except ConfigError:
        return False


def to_tape(rec: Recording, setup: TrainingSetup, layers: tuple[str, ...], describer: str) -> Tape:
    st = rec.storages
    # forward storages never freed, even once the caller let go of the output: the factory's own tensors a
    # loss_fn closes over (targets), or a cache the model keeps; they live for the whole run, like buffers
    kept = [sid for sid, s in st.items() if s.born == "forward" and s.death is None]
    name = {sid: s.name if s.born in ("forward", "input") else f"{s.name}.{sid}" for sid, s in st.items()}
    node_of_op = {n.op: n for n in rec.nodes if n.op is not None}
    kept_set = set(kept)
    keep = [i for i, op in enumerate(rec.ops) if set(op.outputs) - kept_set or i in node_of_op]
    index = {old: new for new, old in enumerate(keep)}

    def kept_at_or_before(i: int) -> int:
        while i >= 0 and i not in index:
            i -= 1
        return index.get(i, 0)

    saves: dict[int, list[int]] = {}
    for n in rec.nodes:
        if n.saves:
            owner = n.op
            if owner is None:  # a node no op returned: its saves go with the op that made the last of them
                owner = max((st[s].op for s in n.saves if st[s].born == "forward"), default=None)
            if owner is not None and owner in index:
                saves.setdefault(owner, []).extend(s for s in n.saves
                                                   if st[s].born in ("forward", "input") and s not in kept_set)
    releases: dict[int, list[str]] = {}
    for sid, s in st.items():
        if s.born == "forward" and s.death is not None and s.death[0] == "forward":
            releases.setdefault(kept_at_or_before(s.death[1]), []).append(name[sid])
    # a tensor no op reads but a later op's node saves (the clone autograd makes of an in-place op's input:
    # `(m - x).clamp_min_(0)` in hinge_embedding_loss) lives until that op, then as long as its save
    last_read: dict[int, int] = {}
    for i, op in enumerate(rec.ops):
        for sid in op.reads:
            last_read[sid] = i
    for old, sids in saves.items():
        for sid in sids:
            if st[sid].born == "forward" and last_read.get(sid, st[sid].op) < old:
                releases.setdefault(index[old], []).append(name[sid])
    regions, offloaded, cached = _regions(rec, keep, setup, layers)
    autocast_cached = set(rec.autocast_cached)
    ops = []
    for new, old in enumerate(keep):
        op = rec.ops[old]
        ops.append(TapeOp(name=op.name, kind=op.aten,
                          inputs=tuple(name[s] for s in op.reads if st[s].born in ("forward", "input")
                                       and s not in kept_set),
                          outputs=tuple(_spec(st[s], name[s]) for s in op.outputs if s not in kept_set),
                          saves=tuple(name[s] for s in saves.get(old, ())), params=op.params, flops=op.flops,
                          region=regions[new], offloaded=offloaded[new], cached=cached[new],
                          releases=tuple(releases.get(new, ())),
                          autocast_cached=tuple(name[s] for s in op.outputs if s in autocast_cached
                                                and s not in kept_set)))
    nodes = tuple(_node(n, st, name, rec.param_grads, index, bool(saves.get(n.op))) for n in rec.nodes)
    return Tape(
        params=[ParamSpec(n, shape) for n, shape, _, _ in rec.params],
        ops=ops,
        inputs=[_spec(s, name[s.id]) for s in rec.inputs],
        buffers=[dataclasses.replace(_spec(s, s.name), requires_grad=False) for s in rec.buffers]
        + [_spec(st[sid], name[sid]) for sid in kept],
        held=tuple(name[s] for s in rec.held) if setup.loop.holds_outputs else (),
        backward=nodes,
        layers=layers,
        buffers_follow_params=False,
        describer=describer,
        gradless=tuple(
            n
            for n, _, _, rg in rec.params
            if (n not in set(rec.param_grads.values()) if setup.batch.passes == "train" else not rg)
        ),
        param_dtypes={n: dt for n, _, dt, _ in rec.params if dt != setup.precision.param},
    )


def _node(n, st, name, param_grads, index, has_saves: bool) -> GradNode:
    steps: list[dict] = []
    released = False
    for kind, sid in n.events:
        s = st[sid]
        if kind == "alloc":
            if not steps or steps[-1]["frees"] or steps[-1]["release"]:
                steps.append({"allocs": [], "grads": [], "frees": [], "release": False})
            if sid in param_grads:
                steps[-1]["grads"].append(param_grads[sid])
            else:
                steps[-1]["allocs"].append(_spec(s, name[sid]))
        else:
            if not steps:
                steps.append({"allocs": [], "grads": [], "frees": [], "release": False})
            if s.born == "backward":
                steps[-1]["frees"].append(name[sid])
            elif not released:
                steps[-1]["release"] = released = True
    if has_saves and not released:
        if not steps:
            steps.append({"allocs": [], "grads": [], "frees": [], "release": False})
        steps[-1]["release"] = True
    return GradNode(name=n.name, op=index.get(n.op) if n.op is not None else None, flops=n.flops,
                    steps=tuple(GradStep(tuple(x["allocs"]), tuple(x["frees"]), tuple(x["grads"]), x["release"])
                                for x in steps))


def _regions(rec: Recording, keep: list[int], setup: TrainingSetup, layers: tuple[str, ...]):
    n = len(keep)
    regions: list[int | None] = [None] * n
    offloaded, cached = [False] * n, [False] * n
    if setup.checkpointing.policy == "none":
        return regions, offloaded, cached
    if setup.checkpointing.policy not in POLICIES:
        raise ConfigError("checkpointing", f"{setup.checkpointing.policy!r} is not defined on a traced model (it names "
                                           f"parts of a transformer block); allowed: {', '.join(POLICIES)}")
    if not layers:
        raise ConfigError("checkpointing", "the traced model has no repeated blocks (an nn.ModuleList or "
                                           "nn.Sequential of one module class) to checkpoint; allowed: none")
    layer_of = {}
    for j, path in enumerate(layers):
        layer_of[path] = j
    segments = checkpoint_segments(setup, len(layers))
    wrap_of: dict[int, tuple[int, str]] = {}
    for seg in segments:
        for j in seg.layers:
            wrap_of[j] = (seg.layers.start, seg.wrap)
    for new, old in enumerate(keep):
        module = rec.ops[old].module
        j = _layer(module, layer_of)
        if j is None:
            continue
        start, wrap = wrap_of[j]
        if wrap in ("checkpoint", "op-policy"):
            regions[new] = start
            cached[new] = wrap == "op-policy" and rec.ops[old].aten in SAC_KEPT
        elif wrap == "offload":
            offloaded[new] = True
    return regions, offloaded, cached


def _layer(module: str, layer_of: dict[str, int]) -> int | None:
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        j = layer_of.get(".".join(parts[:k]))
        if j is not None:
            return j
    return None
