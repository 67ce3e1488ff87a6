"""Recordings of deep models derived from shallow ones, exactly, instead of traced layer by layer.

A decoder of n identical layers is, to autograd and the allocator, one program repeated: tracing its 80 layers
costs 80 times one layer, and they add nothing the third did not show. A HF config whose layer count is a
config key is traced with 3 and with 4 layers; the 4-layer recording is derived from the 3-layer one (`derive`)
and compared with the traced one, item by item (`same`): the ops, their module paths, reads and outputs, the
storages with their bytes, shapes, births and deaths, the autograd nodes with their events and saves, the
parameters, their gradients, what the caller holds. Only if they are equal is the n-layer recording derived
(models/traced/__init__.py `recording`); otherwise (a first layer of its own kind, a shared buffer one layer
makes) the model is traced whole. Layers whose kinds repeat every p layers (`period`: Gemma-2 alternates
sliding-window and full attention, p = 2) are traced with 3p and 4p layers and derived the same way, a group of p
consecutive layers standing for one layer below.

How a recording of 3 layers becomes one of n. Every item (parameter, storage, op, node, module path) belongs to a
layer (its module path is under `layers[i]`) or to none. In each ordered list the items of one layer come in
runs; layer 0's and layer 2's runs keep their place (layer 2 renamed n - 1), and each run of layer 1 is
repeated for layers 1 .. n - 2 (ascending where layer 0 comes before it, descending where layer 2 does: the
backward runs the layers in reverse). A copy for layer j refers to what its original referred to, moved by the
same offset: a tensor of the layer before (the residual stream it reads) becomes the matching tensor of layer
j - 1, matched by place in its layer's runs, which requires layers 0, 1 and 2 to be alike item for item. Storage
ids are renumbered in birth order and a forward tensor's name keeps the index of the op that made it.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from .record import find_layers
from .recording import BackwardNode, ForwardOp, Recording, Storage

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")  # HF config keys that count a decoder's layers
TRACED = 3  # layers traced for the derivation; TRACED + 1 traced to check it
_INDEX = re.compile(r"^(.*)\.(\d+)((?:\.out\d+)?)$")


class NotPeriodic(Exception):
    """The recording is not one layer's program repeated in the way `derive` needs."""


def layer_key(data: dict) -> str | None:
    """The config key that counts the layers, when the config has exactly one (an encoder-decoder has two)."""
    keys = [k for k in LAYER_KEYS if isinstance(data.get(k), int)]
    if len(keys) != 1 or any(isinstance(data.get(k), int) for k in ("num_decoder_layers", "encoder_layers")):
        return None
    return keys[0]


def _prefix(layers: tuple[str, ...], period: int = 1) -> str:
    if len(layers) != TRACED * period:
        raise NotPeriodic(f"{len(layers)} layers found, not {TRACED * period}")
    prefix = layers[0][:-1]
    if any(layer != f"{prefix}{i}" for i, layer in enumerate(layers)):
        raise NotPeriodic("the layers are not one numbered list")
    return prefix


class _Plan:
    """One ordered list of a recording, expanded to n layers: the new order of (item, layer) copies."""

    def __init__(self, tags: list[int | None], n: int) -> None:
        runs: list[tuple[int | None, list[int]]] = []
        for i, t in enumerate(tags):
            if runs and runs[-1][0] == t:
                runs[-1][1].append(i)
            else:
                runs.append((t, [i]))
        self.order: list[tuple[int, int | None]] = []
        for r, (t, items) in enumerate(runs):
            if t == 1:
                layers = range(1, n - 1)
                if self._descending(runs, r):
                    layers = reversed(layers)
                for j in layers:
                    self.order += [(i, j) for i in items]
            else:
                self.order += [(i, n - 1 if t == 2 else t) for i in items]
        self.new = {key: k for k, key in enumerate(self.order)}
        self.tags = tags
        # the place of each layer item within its layer's runs: (run number, offset), for matching layers
        self.place: dict[int, tuple[int, int]] = {}
        self.at: dict[tuple[int, int, int], int] = {}
        seen = {0: 0, 1: 0, 2: 0}
        for t, items in runs:
            if t is None:
                continue
            for k, i in enumerate(items):
                self.place[i] = (seen[t], k)
                self.at[(t, seen[t], k)] = i
            seen[t] += 1

    @staticmethod
    def _descending(runs, r: int) -> bool:
        before = next((t for t, _ in reversed(runs[:r]) if t in (0, 2)), None)
        after = next((t for t, _ in runs[r + 1:] if t in (0, 2)), None)
        if before is not None:
            return before == 2
        if after is not None:
            return after == 0
        raise NotPeriodic("a layer's run with no first or last layer beside it")

    def index(self, i: int, layer: int | None, n: int) -> int:
        """The new place of item `i`'s copy in `layer` (the matching item of that layer, for an item of another)."""
        t = self.tags[i]
        if t is None:
            if layer is not None:
                raise NotPeriodic("a reference from a layer to an item of none, moved")
            return self.new[(i, None)]
        if layer is None or not 0 <= layer < n:
            raise NotPeriodic("a reference outside the layers")
        source = 0 if layer == 0 else 2 if layer == n - 1 else 1
        if source != t:
            key = (source, *self.place[i])
            if key not in self.at:
                raise NotPeriodic("layers that are not alike item for item")
            i = self.at[key]
        return self.new[(i, layer)]


def derive(rec: Recording, n: int, period: int = 1) -> Recording:
    """The recording of the same model with `n` >= 3 x `period` layers (module docstring) from one of 3 x `period`
    layers whose kinds repeat every `period` layers: a group of `period` consecutive layers is then the repeated
    unit; NotPeriodic if it cannot be."""
    if n % period or n < TRACED * period:
        raise NotPeriodic("fewer layers than traced, or not whole periods")
    prefix = _prefix(rec.layers, period)
    layers_n, n = n, n // period  # from here on n counts groups

    def head_of(path: str) -> int | None:
        if path.startswith(prefix):
            head = path[len(prefix):].split(".", 1)[0]
            if head.isdigit() and int(head) < TRACED * period:
                return int(head)
        return None

    def layer_of(path: str) -> int | None:
        head = head_of(path)
        return None if head is None else head // period

    def moved(t: int | None, layer: int | None, u: int | None) -> int | None:
        """The layer an item of tag `u` is in, seen from a copy (of an item of tag `t`) placed in `layer`."""
        if u is None:
            return None
        if t is None:
            if u == 1:
                raise NotPeriodic("an item of no layer refers to a middle layer")
            return 0 if u == 0 else n - 1
        return layer + (u - t)

    def rename(path: str, layer: int | None) -> str:
        head = head_of(path)
        if head is None:
            return path
        return f"{prefix}{layer * period + head % period}" + path[len(f"{prefix}{head}"):]

    ops, nodes = rec.ops, rec.nodes
    op_tag = [layer_of(op.module) for op in ops]
    node_tag = [op_tag[node.op] if node.op is not None else layer_of(node.name) for node in nodes]
    tagged = [k for k, t in enumerate(node_tag) if t is not None]
    for k in range(tagged[0] if tagged else 0, tagged[-1] if tagged else 0):
        if node_tag[k] is None:  # a node no forward op made (a view's), amid a layer's backward: the layer's
            node_tag[k] = node_tag[k - 1]
    born_in: dict[int, int] = {}
    for k, node in enumerate(nodes):
        for kind, sid in node.events:
            if kind == "alloc":
                born_in.setdefault(sid, k)
    sids = sorted(rec.storages)
    position = {sid: p for p, sid in enumerate(sids)}

    def storage_tag(s: Storage) -> int | None:
        if s.born == "forward" and 0 <= s.op < len(ops):
            return op_tag[s.op]
        if s.born == "backward" and s.id in born_in:
            return node_tag[born_in[s.id]]
        return layer_of(s.name)

    s_tag = [storage_tag(rec.storages[sid]) for sid in sids]
    plans = {"op": _Plan(op_tag, n), "node": _Plan(node_tag, n), "storage": _Plan(s_tag, n)}

    def new_sid(sid: int, t: int | None, layer: int | None) -> int:
        p = position[sid]
        return plans["storage"].index(p, moved(t, layer, s_tag[p]), n) + 1

    def new_op(i: int, t: int | None, layer: int | None) -> int:
        return plans["op"].index(i, moved(t, layer, op_tag[i]), n)

    def new_node(k: int, t: int | None, layer: int | None) -> int:
        return plans["node"].index(k, moved(t, layer, node_tag[k]), n)

    storages: dict[int, Storage] = {}
    for p, layer in plans["storage"].order:
        s, t = rec.storages[sids[p]], s_tag[p]
        sid = len(storages) + 1
        op = new_op(s.op, t, layer) if s.born == "forward" and 0 <= s.op < len(ops) else s.op
        death = s.death
        if death is not None and death[0] == "forward":
            death = ("forward", new_op(death[1], t, layer))
        elif death is not None and death[0] == "backward":
            death = ("backward", new_node(death[1], t, layer))
        name = rename(s.name, layer)
        if s.born == "forward" and op != s.op:
            m = _INDEX.match(name)
            if m is None or int(m.group(2)) != s.op:
                raise NotPeriodic(f"a forward tensor's name without its op's index: {s.name}")
            name = f"{m.group(1)}.{op}{m.group(3)}"
        storages[sid] = dataclasses.replace(s, id=sid, name=name, op=op, death=death)
    new_ops = []
    for i, layer in plans["op"].order:
        op, t = ops[i], op_tag[i]
        new_ops.append(ForwardOp(rename(op.name, layer), op.aten, rename(op.module, layer),
                                 tuple(new_sid(s, t, layer) for s in op.reads),
                                 tuple(rename(q, moved(t, layer, layer_of(q))) for q in op.params),
                                 tuple(new_sid(s, t, layer) for s in op.outputs), op.flops))
    new_nodes = []
    for k, layer in plans["node"].order:
        node, t = nodes[k], node_tag[k]
        new_nodes.append(BackwardNode(rename(node.name, layer),
                                      None if node.op is None else new_op(node.op, t, layer),
                                      [(kind, new_sid(s, t, layer)) for kind, s in node.events],
                                      [new_sid(s, t, layer) for s in node.saves], node.flops))

    placed: dict[int, list[tuple[int, int | None]]] = {}  # old storage place -> its copies (new id, layer)
    for k, (q, layer) in enumerate(plans["storage"].order):
        placed.setdefault(q, []).append((k + 1, layer))

    def copies(sid: int) -> list[tuple[int, int | None]]:
        return placed.get(position[sid], [])

    param_tags = [layer_of(name) for name, *_ in rec.params]
    params = [(rename(rec.params[i][0], layer), *rec.params[i][1:]) for i, layer in _Plan(param_tags, n).order]
    module_tags = [layer_of(m) for m in rec.modules]
    modules = [rename(rec.modules[i], layer) for i, layer in _Plan(module_tags, n).order]
    param_grads = {new: rename(name, moved(s_tag[position[sid]], layer, layer_of(name)))
                   for sid, name in rec.param_grads.items() for new, layer in copies(sid)}
    held = sorted(new for sid in rec.held for new, _ in copies(sid))
    autocast_cached = tuple(sorted(new for sid in rec.autocast_cached for new, _ in copies(sid)))
    return dataclasses.replace(
        rec, params=params, buffers=[storages[c] for s in rec.buffers for c, _ in copies(s.id)],
        inputs=[storages[c] for s in rec.inputs for c, _ in copies(s.id)], storages=storages, ops=new_ops,
        nodes=new_nodes, param_grads=param_grads, held=held, modules=modules, autocast_cached=autocast_cached,
        layers=tuple(f"{prefix}{i}" for i in range(layers_n)))


def fingerprints(model, setup) -> list[tuple] | None:
    """Each of the model's repeated layers (record.py `find_layers`), built on the meta device, as what makes two
    layers alike: the same modules, parameter shapes and dtypes, and the same plain attributes (a sliding window,
    an attention type, a dense or sparse MLP) but its index. None unless the model is one numbered list of at
    least 3 layers."""
    with torch.device("meta"):
        net = model.build(setup)[0]
    layers = find_layers(net)
    if len(layers) < TRACED or any(layer != f"{layers[0][:-1]}{i}" for i, layer in enumerate(layers)):
        return None
    return [_fingerprint(net.get_submodule(layer)) for layer in layers]


def period_of(prints: list[tuple] | None) -> int | None:
    """The smallest p such that the layers repeat every p layers (layer i alike layer i mod p, module for module)
    in at least 3 whole periods, or None. A pattern shows here, on every layer of the model, where traces of
    a few layers could miss it."""
    if not prints:
        return None
    for p in range(1, len(prints) // TRACED + 1):
        if len(prints) % p == 0 and all(prints[i] == prints[i % p] for i in range(len(prints))):
            return p
    return None


def period(model, setup) -> int | None:
    """The period of the model's layers (`period_of` its `fingerprints`): 1 where all are alike, 2 where two kinds
    alternate (Gemma-2's sliding-window and full attention), None where no period repeats."""
    return period_of(fingerprints(model, setup))


def uniform(model, setup) -> bool:
    """The model's repeated layers are alike (`period` 1): one list of at least 3 layers, each with the same
    modules, parameter shapes and dtypes, and plain attributes but its index."""
    return period(model, setup) == 1


def _fingerprint(layer) -> tuple:
    out = []
    for name, m in layer.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k != "layer_idx"
                             and isinstance(v, (bool, int, float, str, type(None)))))
        params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in m.named_parameters(recurse=False))
        out.append((name, type(m).__name__, plain, params))
    return tuple(out)


def same(a: Recording, b: Recording) -> bool:
    """Two recordings equal in everything the replay reads (and every name)."""
    return (a.params == b.params and a.storages == b.storages and a.ops == b.ops and a.nodes == b.nodes
            and a.param_grads == b.param_grads and a.held == b.held and a.layers == b.layers
            and a.modules == b.modules and a.autocast_cached == b.autocast_cached
            and [s.id for s in a.buffers] == [s.id for s in b.buffers]
            and [s.id for s in a.inputs] == [s.id for s in b.inputs])


__all__ = ["derive", "same", "uniform", "period", "period_of", "fingerprints", "layer_key", "NotPeriodic", "TRACED"]
