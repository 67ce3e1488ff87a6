"""Compiled captures of deep models derived from shallow ones, exactly, instead of compiled whole.

Compiling costs time per layer (dynamo traces, AOTAutograd partitions and inductor lowers every layer again), and a
decoder of n identical layers is, past its first and last few, one layer's program repeated. A HF config whose
layer count is one config key (models/traced/depth.py `layer_key`), whose layers are alike (`uniform`), is compiled
with 3, 4 and 5 layers (then, where those do not fit, 6: the window 4, 5, 6; then 7: 5, 6, 7; each only while the
layers compiled in all stay fewer than the model's); the deepest of a window is
derived from the two others (`fit`) and must come out equal to its compile, list by list: every plan event, input
and output name, run argument and output, storage, parameter, gradient, held tensor. Only then is the n-layer
capture derived, by the same rules (`derive`, `rebuild`); otherwise (layers that alternate, an inductor schedule
that is not periodic yet at these depths, anything else) the caller compiles the model whole. Why a window of
three and not two: inductor's buffer reuse reaches back across layers (a layer takes over a buffer a layer or two
before it freed), so the first layers, and the first ones the backward visits, are programs of their own until
the reuse pool repeats (the tiny Llama of examples/ fits the window 4, 5, 6; a Llama-3-8B-sized one 3, 4, 5).

What a capture is, seen across depths. Every name in it is a number in a numbering of its own: inductor's buffers
(`bufN`, in lowering order, one numbering per graph), the graph inputs (`primals_N`, `tangents_N`, the forward's
FX names of the saved tensors, `view_N`), the storage keys (renamed here by first appearance: the runs' arguments
and outputs, then the parameters, buffers, inputs, held tensors, gradients and storages), the layer index of a
parameter's name (`model.layers.N.…`), a run's FLOPs; and a size may grow with the layers (the dropout seeds'
buffer). `canonical` writes the capture as named lists of tokens, each name with what it names (its storage's
bytes and dtype, a parameter's shape). Each list at one layer more is the list at one layer less with blocks
inserted (`_inserts`: aligned item by item, or run by run of like items, by `difflib` on the tokens with their
numbers blanked; only equal items and insertions are accepted): a layer's items, in forward order in the forward,
in reverse in the backward, in both in the forward's outputs (the saved tensors and the per-layer caches). Then,
per occurrence of a number:
- in a part common to both depths, the number moves by the same step per added layer (`alpha`: 0 for a name
  before the inserted layer in its numbering, the layer's count after it);
- in an inserted block X, the copies for the added layers continue the block beside it, Y, of the same shape:
  copy m of X is X + m (X - Y) + k alpha_Y for k added layers, m = 0 .. k, placed after X (or, with the block
  after X, Z, before it, with X - Z and alpha_Z): a buffer numbered in order keeps its place, a parameter's layer
  index counts down where the backward visits the layers in reverse.
An insertion may sit at any place of its periodic run that gives the same alignment (`_slide`); which place (and
which alignment) is a rule (`RULES`: the first place whose step equals the step before it, the last or first with
a block beside it, ...), chosen per list as the first that gives the deepest compile of the window exactly, and
applied unchanged for n. So a reference from a layer to the one before it (the residual stream, a buffer it
reuses) stays one layer back, a reference to what no layer owns (the rotary tables, the embedding) stays, and the
names after the layers move. The derived capture's storage keys are those ordinals (`to_tape` only matches them);
inductor's own estimate of a plan's peak (`Plan.peak_estimate`, read by nothing downstream) is left None, as it
is no sum over layers. The GEMM scratchpads of the shallow compiles are markers (workspace.py `deferred`), their
probes running meanwhile; the derived capture gets their bytes (`_resolve`).

Not derived exactly yet: names across a power of ten. Inductor frees the buffers of one kernel in the order of
their names as strings (torch/_inductor/scheduler.py `free_buffers`: `sorted(...)`), and its reuse pool hands the
last freed buffer of a size to the next allocation of that size (codegen/wrapper.py `MemoryPlanningState`); where
one such group holds buffer numbers on both sides of 1000 (`buf999`, `buf1003`), the string order is not the
number order the shallow compiles show, and the compile gives the next allocation the other of the two
same-size buffers. The derived capture then names that reuse after the other buffer: the same bytes at every
event (Llama-3-8B-sized, 32 layers: 8 of 4,353 backward plan events; the simulated peak the same, bench/RESULTS.md
"Compiled describer: speed"). Replaying the pool needs the free groups, which plan.py does not record yet.
"""

from __future__ import annotations

import dataclasses
import re
from difflib import SequenceMatcher

from ..config import TrainingSetup
from ..traced.depth import layer_key, uniform
from ..traced.model import TracedModel, from_hf_dict
from . import workspace
from .capture import Capture, Run, compile_capture
from .fork import forked_compile
from .plan import Plan, marker_of, scratch_alloc

WINDOWS = ((3, 4, 5), (4, 5, 6), (5, 6, 7))  # the layers compiled, in turn: two derive, the third checks
_N = "\x00n"  # a name: (_N, namespace, stem, suffix, what it names, number | None)
_NUMBERED = re.compile(r"^(.*?)(\d+)((?:\.workspace)?)$")


class NotPeriodic(Exception):
    """The captures are not one layer's program repeated in the way `extend` needs."""


def _graph_name(graph: int, name, what):
    if name is None:
        return None
    m = _NUMBERED.match(name)
    if m is None:
        return (_N, f"g{graph}", name, "", what, None)
    return (_N, f"g{graph}", m.group(1), m.group(3), what, int(m.group(2)))


def _described(cap: Capture) -> list[dict]:
    """Per plan, what each of its names is: its storage's (bytes, dtype) (what inductor's reuse keeps: a buffer
    handed on under another name may have another shape)."""
    out = []
    for i, plan in enumerate(cap.plans):
        what: dict = {}
        run = next((r for r in cap.runs if r.graph == i), None)
        if run is not None:
            what.update({n: cap.storages[k][:2] for n, k in zip(plan.inputs, run.args) if k in cap.storages})
        for ev in plan.events:
            if ev[0] == "alloc":
                what[ev[1]] = tuple(ev[2:4])
            elif ev[0] == "alias":
                what[ev[1]] = what.get(ev[2])
        out.append(what)
    return out


KNOWN = frozenset(("plans", "runs", "storages", "params", "param_specs", "buffers", "inputs", "held", "grads",
                   "param_strides", "ties", "graph_count", "break_reasons", "layers", "model_class"))


def canonical(cap: Capture) -> dict[str, list[tuple]]:
    """The capture as named lists of tokens, every number a numbered name (module docstring)."""
    unknown = {f.name for f in dataclasses.fields(cap)} - KNOWN
    if unknown:  # a field added to `Capture` that the derivation does not carry: compiled whole
        raise NotPeriodic(f"capture fields not derived: {', '.join(sorted(unknown))}")
    if not cap.layers:
        raise NotPeriodic("no layers")
    prefix = cap.layers[0][:-1]
    if any(layer != f"{prefix}{i}" for i, layer in enumerate(cap.layers)):
        raise NotPeriodic("the layers are not one numbered list")
    module = re.compile(rf"^{re.escape(prefix)}(\d+)((?:\..*)?)$")
    keys: dict = {}

    def key(k):
        if k is None:
            return None
        if k not in keys:
            keys[k] = len(keys) + 1
        return (_N, "k", "", "", cap.storages.get(k), keys[k])

    specs = {n: tuple(rest) for n, *rest in cap.param_specs}

    def param(name: str):
        m = module.match(name)
        if m is None:
            return (_N, "p", name, "", specs.get(name), None)
        return (_N, "p", prefix, m.group(2), specs.get(name), int(m.group(1)))

    out: dict[str, list[tuple]] = {}
    out["meta"] = [(cap.graph_count, tuple(cap.break_reasons), cap.model_class, len(cap.plans), len(cap.runs))]
    for r, run in enumerate(cap.runs):
        out[f"run{r}"] = [(run.graph, (_N, "f", "flops", "", None, run.flops))]
        out[f"run{r}.args"] = [(key(k),) for k in run.args]
        out[f"run{r}.outputs"] = [(key(k),) for k in run.outputs]
    for i, (plan, what) in enumerate(zip(cap.plans, _described(cap))):
        out[f"plan{i}"] = [(plan.is_backward,)]
        out[f"plan{i}.inputs"] = [(_graph_name(i, x, what.get(x)),) for x in plan.inputs]
        out[f"plan{i}.outputs"] = [(_graph_name(i, x, what.get(x)),) for x in plan.outputs]
        events = []
        for ev in plan.events:
            names = 3 if ev[0] == "alias" else 2
            events.append(tuple(_graph_name(i, x, what.get(x)) if 0 < j < names else x for j, x in enumerate(ev)))
        out[f"plan{i}.events"] = events
    out["params"] = [(key(k), param(n)) for k, n in cap.params.items()]
    out["param_specs"] = [(param(n), *rest) for n, *rest in cap.param_specs]
    out["buffers"] = [(key(k), param(n)) for k, n in cap.buffers.items()]
    out["inputs"] = [(key(k), n) for k, n in cap.inputs.items()]
    held = sorted(key(k) for k in cap.held)
    out["held"] = [(k,) for k in held]
    out["grads"] = [(param(n), key(k)) for n, k in cap.grads.items()]
    out["param_strides"] = [(param(n), s) for n, s in cap.param_strides.items()]
    out["ties"] = [(param(n), param(of), before) for n, of, before in cap.ties]
    order = sorted(cap.storages, key=lambda k: key(k)[5])
    out["storages"] = [(key(k), *cap.storages[k]) for k in order]
    return out


def _is_name(x) -> bool:
    return isinstance(x, tuple) and len(x) == 6 and x[0] == _N


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shape(token, coarse: bool):
    """What must be equal between two depths: the token with its names' numbers blanked, and with `coarse` every
    number (a size that grows with the layers: the dropout seeds' buffer, one seed per dropout)."""
    if _int(token):
        return None if coarse else token
    if _is_name(token):
        return (*token[:4], _shape(token[4], coarse), None)
    if isinstance(token, tuple):
        return tuple(_shape(x, coarse) for x in token)
    return token


def _numbers(token) -> list[int]:
    """Every number of the token, in order (a name's, a size's, a shape's)."""
    if _int(token):
        return [token]
    if isinstance(token, tuple):
        return [n for x in token for n in _numbers(x)]
    return []


def _moved(token, steps):
    """The token with its numbers (`_numbers` order) moved by `steps`."""
    it = iter(steps)

    def move(x):
        if _int(x):
            return x + next(it)
        if isinstance(x, tuple):
            return tuple(move(y) for y in x)
        return x

    return move(token)


def _minus(b: tuple, a: tuple) -> list[int]:
    return [x - y for x, y in zip(_numbers(b), _numbers(a))]


def _slide(sb: list, j: int, size: int, lo: int, hi: int) -> list[int]:
    """The places an insertion of `size` at `j` of `sb` may equally be at (the alignment is the same), within
    [lo, hi]: left while the element before it equals its last, right while its first equals the one after it."""
    places = [j]
    k = j
    while k > lo and sb[k - 1] == sb[k - 1 + size]:
        k -= 1
        places.append(k)
    k = j
    while k + size < hi and sb[k] == sb[k + size]:
        k += 1
        places.append(k)
    return sorted(places)


def _steady(high: list[tuple], sb: list, y: int, size: int, lo: int) -> bool:
    """Whether the block at `y` + `size` steps from the one at `y` as that one from the one before it."""
    w, x = y - size, y + size
    if w < lo or sb[w:y] != sb[y:x]:
        return False
    return all(_minus(high[x + k], high[y + k]) == _minus(high[y + k], high[w + k]) for k in range(size))


def _runs(shapes: list) -> list[tuple[object, int, int]]:
    """(shape, count, start) of each run of equal shapes."""
    out: list[list] = []
    for i, x in enumerate(shapes):
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1, i])
    return [tuple(r) for r in out]


def _inserts(low: list[tuple], high: list[tuple], by_runs: bool) -> list[tuple[int, int]]:
    """Where `high` is `low` with items inserted: (place in `high`, count) of each insertion, adjacent ones
    joined. The lists are aligned item by item, or with `by_runs` run by run (`_runs`: what one layer adds to a run
    of like items, the casts or frees of every layer's weights that inductor hoists together, is an insertion at
    its end); an item may also change its sizes alone (`_shape(coarse=True)` equal: the dropout seeds' buffer)."""
    ra = _runs([_shape(t, False) for t in low]) if by_runs else [(_shape(t, False), 1, i) for i, t in enumerate(low)]
    rb = _runs([_shape(t, False) for t in high]) if by_runs else [(_shape(t, False), 1, i)
                                                                    for i, t in enumerate(high)]
    found: list[list[int]] = []

    def add(j: int, size: int) -> None:
        if found and found[-1][0] + found[-1][1] == j:
            found[-1][1] += size
        elif size:
            found.append([j, size])

    matcher = SequenceMatcher(None, [r[0] for r in ra], [r[0] for r in rb], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            add(rb[j1][2], sum(r[1] for r in rb[j1:j2]))
            continue
        if tag == "replace" and i2 - i1 == j2 - j1 and all(
                _shape(low[x[2]], True) == _shape(high[y[2]], True) for x, y in zip(ra[i1:i2], rb[j1:j2])):
            tag = "equal"  # the same but for sizes that grow with the layers
        if tag != "equal":
            raise NotPeriodic(f"a {tag} between depths")
        for x, y in zip(ra[i1:i2], rb[j1:j2]):
            if y[1] < x[1]:
                raise NotPeriodic("a run shorter at more layers")
            add(y[2] + x[1], y[1] - x[1])
    return [(j, size) for j, size in found]


def _alpha(low: list[tuple], high: list[tuple], inserts: list[tuple[int, int]]) -> list[list[int] | None]:
    alpha: list[list[int] | None] = [None] * len(high)
    shift, at = 0, 0
    for j, size in inserts + [(len(high), 0)]:
        for k in range(at, j):
            alpha[k] = _minus(high[k], low[k - shift])
        shift += size
        at = j + size
    return alpha


PLACES = ("steady", "before, last", "after, first", "both, middle", "before, first", "after, last",
          "before, middle", "after, middle")  # where an insertion is placed in its periodic run (`_places`)
RULES = PLACES + tuple(f"runs, {p}" for p in PLACES)  # tried in this order by `fit`; "runs": `_inserts(by_runs)`


def _places(sb: list, high: list[tuple], found: list[tuple[int, int]], rule: str) -> list[tuple[int, int, str]]:
    """Each insertion of `found` placed by `rule` among the places of the same alignment (`_slide`) where a block of
    its shape is beside it: "before" (copies go after it, stepping from the block before) or "after" (copies go
    before it, stepping from the block after); "steady": a place whose step from the block before equals that
    block's from the one before it; then the first, last or middle such place; NotPeriodic where there is none."""
    inserts: list[tuple[int, int, str]] = []
    for i, (j, size) in enumerate(found):
        lo = inserts[-1][0] + inserts[-1][1] if inserts else 0
        hi = found[i + 1][0] if i + 1 < len(found) else len(high)
        places = _slide(sb, j, size, lo, hi)
        before = [k for k in places if k - size >= lo and sb[k - size:k] == sb[k:k + size]]
        after = [k for k in places if k + 2 * size <= hi and sb[k + size:k + 2 * size] == sb[k:k + size]]
        side, which = rule.split(", ") if ", " in rule else ("before", "middle")
        if rule == "steady":
            chosen = [k for k in before if _steady(high, sb, k - size, size, lo)]
        elif side == "both":
            chosen, side = [k for k in before if k in after], "before"
        else:
            chosen = before if side == "before" else after
        if not chosen:
            raise NotPeriodic("an inserted block with no block of its shape beside it")
        k = chosen[0] if which == "first" else chosen[-1] if which == "last" else chosen[len(chosen) // 2]
        inserts.append((k, size, side))
    return inserts


def extend(low: list[tuple], high: list[tuple], added: int, rule: str) -> list[tuple]:
    """The list of `high` (one layer more than `low`) with `added` more layers, its insertions placed by `rule`
    (`_places`; module docstring)."""
    sb = [_shape(t, False) for t in high]
    by_runs = rule.startswith("runs, ")
    found = _inserts(low, high, by_runs)
    inserts = _places(sb, high, found, rule.removeprefix("runs, ")) if found else []
    alpha = _alpha(low, high, [(j, size) for j, size, _ in inserts])
    out: list[tuple] = []
    at = 0
    for j, size, where in inserts + [(len(high), 0, "")]:
        out += [_moved(high[k], [added * s for s in alpha[k]]) for k in range(at, j)]
        if not size:
            break
        block = high[j:j + size]
        side = range(j - size, j) if where == "before" else range(j + size, j + 2 * size)
        order = range(added + 1) if where == "before" else range(added, -1, -1)
        if any(alpha[i] is None for i in side):
            raise NotPeriodic("an inserted block beside another")
        beta = [_minus(x, high[i]) for x, i in zip(block, side)]
        for m in order:
            out += [_moved(x, [m * b + added * s for b, s in zip(bs, alpha[i])]) for x, bs, i in zip(block, beta, side)]
        at = j + size
    return out


def fit(low: Capture, high: Capture, check: Capture) -> dict[str, str]:
    """Per list, the first rule (`RULES`) by which the lists of `low` and `high` (one layer more) give those of
    `check` (one layer more again) exactly; NotPeriodic where no rule does."""
    a, b, c = canonical(low), canonical(high), canonical(check)
    if not a.keys() == b.keys() == c.keys():
        raise NotPeriodic("a different number of graphs or runs")
    rules = {}
    for name in b:
        for rule in RULES:
            try:
                if extend(a[name], b[name], 1, rule) == c[name]:
                    rules[name] = rule
                    break
            except NotPeriodic:
                continue
        else:
            raise NotPeriodic(f"{name}: no rule gives the deeper capture")
    return rules


def derive(low: Capture, high: Capture, n: int, depth: int, rules: dict[str, str]) -> dict[str, list[tuple]]:
    """The canonical lists (`canonical`) of the `n`-layer capture, from those of `depth` and `depth` + 1 layers,
    each list's insertions placed by its rule (`fit`)."""
    a, b = canonical(low), canonical(high)
    return {name: extend(a[name], b[name], n - depth - 1, rules[name]) for name in b}


def _string(x):
    if not _is_name(x):
        return x
    _, _, stem, suffix, _, number = x
    return stem if number is None else f"{stem}{number}{suffix}"


def _key_of(x):
    return None if x is None else x[5]


def rebuild(lists: dict[str, list[tuple]], n: int, layers_prefix: str) -> Capture:
    """The `Capture` of canonical lists (keys are the ordinals)."""
    graph_count, reasons, model_class, n_plans, n_runs = lists["meta"][0]
    plans = []
    for i in range(n_plans):
        events = [tuple(_string(x) for x in ev) for ev in lists[f"plan{i}.events"]]
        plans.append(Plan(is_backward=lists[f"plan{i}"][0][0],
                          inputs=[_string(t[0]) for t in lists[f"plan{i}.inputs"]],
                          outputs=[_string(t[0]) for t in lists[f"plan{i}.outputs"]], events=events))
    runs = []
    for r in range(n_runs):
        graph, flops = lists[f"run{r}"][0]
        runs.append(Run(graph, [_key_of(t[0]) for t in lists[f"run{r}.args"]],
                        [_key_of(t[0]) for t in lists[f"run{r}.outputs"]], flops[5]))
    return Capture(
        plans=plans, runs=runs, storages={_key_of(k): tuple(rest) for k, *rest in lists["storages"]},
        params={_key_of(k): _string(p) for k, p in lists["params"]},
        param_specs=[(_string(p), *rest) for p, *rest in lists["param_specs"]],
        buffers={_key_of(k): _string(p) for k, p in lists["buffers"]},
        inputs={_key_of(k): name for k, name in lists["inputs"]},
        held={_key_of(t[0]) for t in lists["held"]},
        grads={_string(p): _key_of(k) for p, k in lists["grads"]},
        param_strides={_string(p): s for p, s in lists["param_strides"]},
        ties=tuple((_string(p), _string(of), before) for p, of, before in lists["ties"]),
        graph_count=graph_count, break_reasons=list(reasons),
        layers=tuple(f"{layers_prefix}{i}" for i in range(n)), model_class=model_class)


def shallow(model: TracedModel, setup: TrainingSetup) -> tuple[str, int] | None:
    """(the layer-count key, n) where `capture_by_depth` may derive `model`, else None: a HF config of one layer
    count, more layers than the first window compiles in all, its layers alike (models/traced/depth.py `uniform`),
    and nothing in the setup that tells a layer by its index (frozen-parameter patterns, checkpointing other than
    none, full or op-policy, LoRA targets naming a number)."""
    if (
        model.kind != "hf"
        or setup.optimizer.frozen
        or setup.checkpointing.policy not in ("none", "full", "op-policy")
        or any(ch.isdigit() for target in setup.lora.targets for ch in target)
    ):  # LoRA on some layers only
        return None
    data = model.hf_dict()
    key = layer_key(data)
    n = data.get(key) if key else None
    if not isinstance(n, int) or n <= sum(WINDOWS[0]) or not uniform(model, setup):
        return None
    return key, n


def _resolve(cap: Capture) -> Capture:
    """The GEMM scratchpads of `cap`'s plans measured (workspace.py `resolved`): a marker's block replaced by the
    bytes, or gone with its drop where the GEMM takes none."""
    for plan in cap.plans:
        events, gone = [], set()
        for ev in plan.events:
            if marker_of(ev) is not None:
                nbytes = workspace.resolved(marker_of(ev))
                if not nbytes:
                    gone.add(ev[1])
                    continue
                ev = scratch_alloc(ev[1], nbytes)
            elif ev[0] == "drop" and ev[1] in gone:
                gone.discard(ev[1])
                continue
            events.append(ev)
        plan.events = events
    return cap


def from_window(caps: dict, window: tuple[int, int, int], n: int) -> Capture | None:
    """The `n`-layer capture derived from the compiles `caps[d]` of the window's depths (`fit` on all three, then
    `derive` from the first two), its GEMM scratchpads still markers where they were; None where no rule fits."""
    first, second, third = window
    try:
        rules = fit(caps[first], caps[second], caps[third])
        lists = derive(caps[first], caps[second], n, first, rules)
    except NotPeriodic:
        return None
    return rebuild(lists, n, caps[first].layers[0][:-1])


def capture_by_depth(model: TracedModel, setup: TrainingSetup) -> Capture | None:
    """The capture of `model` derived from its compiles at few layers, checked (module docstring), or None where it
    cannot be shown exact (then the caller compiles the model whole). A window is compiled only while the layers
    compiled in all stay fewer than the model's (past that, compiling it whole is cheaper). The first window's
    deepest compile runs in a forked process beside the others (fork.py), the result the same."""
    found = shallow(model, setup)
    if found is None:
        return None
    key, n = found
    data = model.hf_dict()
    caps: dict[int, Capture] = {}
    cap = None
    with workspace.deferred():  # the probes run meanwhile, their bytes read once the derivation holds
        for window in WINDOWS:
            new = [d for d in window if d not in caps]
            if sum(caps) + sum(new) >= n:
                break
            elsewhere = {}
            if len(new) == 3:
                deepest = new[-1]
                deeper = from_hf_dict({**data, key: deepest}, model.name)
                elsewhere[deepest] = forked_compile(compile_capture, deeper, setup)
            for d in new:
                got = elsewhere[d]() if d in elsewhere else None
                caps[d] = got if got is not None else compile_capture(from_hf_dict({**data, key: d}, model.name),
                                                                      setup)
            cap = from_window(caps, window, n)
            if cap is not None:
                break
    return _resolve(cap) if cap is not None else None


__all__ = ["capture_by_depth", "from_window", "canonical", "fit", "derive", "extend", "rebuild", "shallow", "WINDOWS",
           "RULES", "NotPeriodic"]
