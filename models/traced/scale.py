"""Recordings at other micro-batch sizes, derived exactly instead of traced again.

A max-batch search or a sweep over the micro-batch asks for one recording per size; tracing a large model
takes seconds each time. Three recordings of one model and setup at micro-batch sizes b1 < b2 < b3 that are
the same program (the same ops on the same storages in the same order, the same autograd nodes with the
same events: `signature`) and whose every size (each storage's bytes and each dimension of its shape, each
op's FLOPs) is affine in the micro-batch (a + b x B: `affine`) give the recording at any size B by that
formula (`derive`). Whatever is not affine (a B x B tensor, a kernel chosen by size) shows in the three
points, and then nothing is derived: the size is traced. A size that is affine only from some micro-batch on is
derived from the points from there on, three or more that are affine, for sizes from their smallest up.

A kernel's own temporary whose size a GPU rule gives (a CUDA reduction's staging buffer and semaphores: its blocks
per output grow with the inputs up to the grid's fill, in steps, Reduce.cuh setReduceConfig) is not affine in the
batch, but the rule's arguments are (the reduction's outputs and inputs per output, Storage.rule): those are checked
and derived as every other size, and the temporary's bytes computed from them by the rule (`RULES`); where the rule
gives none at the size asked (the kernel reduces within blocks there: another program), nothing is derived.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..gpu import reduce_staging_of
from .recording import Recording, Storage

# a temporary's role -> its bytes from the rule's arguments (Storage.rule[1:]; models/traced/cuda_program.py)
RULES: dict[str, Callable[[tuple], int]] = {
    "reduce_staging": lambda args: reduce_staging_of(args)[0],
    "reduce_semaphores": lambda args: reduce_staging_of(args)[1],
}
SIZED = 2  # the rule's arguments that follow the batch (a reduction's outputs and inputs per output); the rest fixed


def signature(rec: Recording) -> tuple:
    """Everything in a recording but its sizes."""
    return (tuple((op.aten, op.module, op.reads, op.params, op.outputs) for op in rec.ops),
            tuple((n.name, n.op, tuple(n.events), tuple(n.saves)) for n in rec.nodes),
            tuple((sid, s.born, s.op, s.death, s.dtype, s.requires_grad, len(s.shape), s.name,
                   None if s.rule is None else (s.rule[0], *s.rule[1 + SIZED:]))
                  for sid, s in rec.storages.items()),
            tuple(sorted(rec.param_grads.items())), tuple(rec.held), rec.layers, rec.autocast_cached,
            tuple((n, shape, dt, rg) for n, shape, dt, rg in rec.params))


def _numbers(rec: Recording) -> list[int]:
    """Every size of a recording, in a fixed order (storages: bytes and shape, or a rule's sized arguments; ops and
    nodes: FLOPs)."""
    out: list[int] = []
    for s in rec.storages.values():
        if s.rule is not None:
            out.extend(s.rule[1:1 + SIZED])
            continue
        out.append(s.nbytes)
        out.extend(s.shape)
    out.extend(op.flops for op in rec.ops)
    out.extend(n.flops for n in rec.nodes)
    return out


def affine(points: dict[int, Recording]) -> bool:
    """Three or more recordings (micro-batch -> recording) of one program whose sizes are affine in it."""
    if len(points) < 3:
        return False
    sizes = sorted(points)
    first = signature(points[sizes[0]])
    if any(signature(points[b]) != first for b in sizes[1:]):
        return False
    b1, b2 = sizes[0], sizes[1]
    n1, n2 = _numbers(points[b1]), _numbers(points[b2])
    for b in sizes[2:]:
        nb = _numbers(points[b])
        if any((y - x) * (b2 - b1) != (z - x) * (b - b1) for x, z, y in zip(n1, n2, nb)):
            return False
    return True


def derive(points: dict[int, Recording], micro_batch: int) -> Recording | None:
    """The recording at `micro_batch` from `points` (see the module docstring), or None if they do not allow it
    (fewer than three of one program, not affine, or a size that would not be a whole number or would be
    negative). Only sizes from the smallest point used up are derived: a micro-batch of 1 is often a program of its
    own (a size-1 dimension lets a reshape skip its copy)."""
    groups: dict[tuple, dict[int, Recording]] = {}
    for b, rec in points.items():
        groups.setdefault(signature(rec), {})[b] = rec
    points = max(groups.values(), key=len, default={})
    sizes = sorted(points)
    for k in range(len(sizes) - 2):  # all the points, else those above a kink (a staging buffer reaching its cap)
        if micro_batch >= sizes[k] and affine({b: points[b] for b in sizes[k:]}):
            points = {b: points[b] for b in sizes[k:]}
            break
    else:
        return None
    b1, b2 = sorted(points)[:2]
    r1, r2 = points[b1], points[b2]

    def at(x: int, y: int) -> int:
        q, rem = divmod((y - x) * (micro_batch - b1), b2 - b1)
        if rem:
            raise ValueError("not a whole number")
        return x + q

    try:
        storages = {}
        for sid, s in r1.storages.items():
            t = r2.storages[sid]
            value = _ruled(s, t, at) if s.rule is not None else \
                dataclasses.replace(s, nbytes=at(s.nbytes, t.nbytes),
                                    shape=tuple(at(a, c) for a, c in zip(s.shape, t.shape)))
            if value is None or value.nbytes < 0 or min(value.shape, default=0) < 0:
                return None
            storages[sid] = value
        ops = [dataclasses.replace(op, flops=at(op.flops, o2.flops)) for op, o2 in zip(r1.ops, r2.ops)]
        nodes = [dataclasses.replace(n, flops=at(n.flops, m.flops)) for n, m in zip(r1.nodes, r2.nodes)]
    except ValueError:
        return None
    by_id = {s.id: s for s in storages.values()}
    return dataclasses.replace(r1, storages=storages, ops=ops, nodes=nodes,
                               buffers=[by_id[s.id] for s in r1.buffers], inputs=[by_id[s.id] for s in r1.inputs])


def _ruled(s: Storage, t: Storage, at: Callable[[int, int], int]) -> Storage | None:
    """A rule's temporary (`s` at one point, `t` at another) at the size asked: its sized arguments derived, its bytes
    computed by its rule; None where the rule gives none there (another program: traced)."""
    role, *args = s.rule
    sized = [at(a, c) for a, c in zip(args[:SIZED], t.rule[1:1 + SIZED])]
    if min(sized) <= 0:
        return None
    rule = (*sized, *args[SIZED:])
    nbytes = RULES[role](rule)
    if nbytes <= 0:
        return None
    return dataclasses.replace(s, nbytes=nbytes, shape=(nbytes,), rule=(role, *rule))
