"""models/compile/depth.py: a compiled capture derived from compiles of few layers is the capture of the whole model
compiled, through `convert.to_tape` the same tape; a model that is not one layer's program repeated is compiled
whole. And workspace.py's GEMM-scratchpad disk cache.

Compiles are slow on a small machine (a tiny model: ~10 s each): each model's compiles are one module-scoped
fixture that keeps every capture it compiled, and the whole-model compiles are the ones the derivations are held
against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peakledger.models.compile import depth, workspace
from peakledger.models.compile.capture import compile_capture
from peakledger.models.compile.convert import to_tape
from peakledger.models.config import TrainingSetup
from peakledger.models.traced import from_hf_dict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = {  # name -> (config, layer key, precision, the window of compiles that fits, depths derived and compiled)
    "llama-fp32": (EXAMPLES / "hf-llama-tiny" / "config.json", "num_hidden_layers", "fp32", (4, 5, 6), (8,)),
    "gpt2-fp32": (EXAMPLES / "hf-gpt2-tiny" / "config.json", "n_layer", "fp32", (5, 6, 7), (9,)),
}


def _setup(precision: str) -> TrainingSetup:
    return TrainingSetup(micro_batch=2, seq_len=32, steps=1, precision=precision, compile=True)


def _tape(cap, setup):
    return to_tape(cap, setup, describer="compiled")


@pytest.fixture(scope="module", params=list(MODELS))
def compiled(request, tmp_path_factory):
    """(name, setup, window, {depth: capture}) with the window's compiles and the whole compiles of the depths
    derived, as `capture_by_depth` compiles them (its GEMM scratchpads deferred)."""
    path, key, precision, window, derived = MODELS[request.param]
    data = json.loads(path.read_text())
    setup = _setup(precision)
    mp = pytest.MonkeyPatch()
    mp.setenv(workspace.CACHE_ENV, str(tmp_path_factory.mktemp("gemm") / "cache.json"))
    try:
        with workspace.deferred():
            caps = {d: compile_capture(from_hf_dict({**data, key: d}, path.parent.name), setup) for d in window}
        caps.update({n: compile_capture(from_hf_dict({**data, key: n}, path.parent.name), setup) for n in derived})
    finally:
        mp.undo()
    return request.param, setup, window, caps


def test_derived_capture_gives_the_compiled_tape(compiled):
    name, setup, window, caps = compiled
    for n in MODELS[name][4]:
        derived = depth.from_window(caps, window, n)
        assert derived is not None, f"{name}: not derived"
        derived = depth._resolve(derived)
        assert len(derived.layers) == n
        assert _tape(derived, setup) == _tape(caps[n], setup), f"{name} at {n} layers"
        assert depth.canonical(derived) == depth.canonical(caps[n])  # every list of the capture, renamed alike


def test_a_capture_that_is_not_periodic_is_not_derived(compiled):
    _, _, (a, b, c), caps = compiled
    with pytest.raises(depth.NotPeriodic):  # the deepest compile replaced by the shallowest: not one more layer
        depth.fit(caps[a], caps[b], caps[a])
    with pytest.raises(depth.NotPeriodic):  # depths swapped: a layer less
        depth.fit(caps[b], caps[a], caps[c])
    assert depth.from_window({a: caps[a], b: caps[b], c: caps[a]}, (a, b, c), 16) is None


def test_a_model_not_periodic_is_compiled_whole(monkeypatch):
    """`cached_capture` compiles the model whole where the compiles of few layers are not one program repeated (here:
    no window of them fits, the compiles stood in for)."""
    import peakledger.models.compile as compiled_describer
    import peakledger.models.compile.capture as capture

    llama = json.loads((EXAMPLES / "hf-llama-tiny" / "config.json").read_text())
    model = from_hf_dict({**llama, "num_hidden_layers": 32}, "llama")
    setup = _setup("fp32")
    other = object()
    calls = []

    def refuse(*caps):
        raise depth.NotPeriodic("a stand-in")

    monkeypatch.setattr(depth, "compile_capture", lambda m, s: calls.append(m.hf_dict()["num_hidden_layers"]))
    monkeypatch.setattr(depth, "fit", refuse)
    monkeypatch.setattr(capture, "compile_capture", lambda m, s, **kw: other)
    compiled_describer._CACHE.clear()
    assert depth.capture_by_depth(model, setup) is None
    assert calls == [3, 4, 5, 6, 7]  # every window, (3, 4, 5), (4, 5, 6) and (5, 6, 7), compiled; none fits
    calls.clear()
    shallower = from_hf_dict({**llama, "num_hidden_layers": 20}, "llama")
    assert depth.capture_by_depth(shallower, setup) is None
    assert calls == [3, 4, 5, 6]  # (5, 6, 7) not compiled: 25 layers compiled in all for 20 (cheaper whole)
    assert compiled_describer.cached_capture(model, setup) is other
    compiled_describer._CACHE.clear()


def test_a_shallow_or_unlike_model_is_not_derived():
    llama = json.loads((EXAMPLES / "hf-llama-tiny" / "config.json").read_text())
    setup = _setup("fp32")
    first = sum(depth.WINDOWS[0])  # layers the first window compiles
    assert depth.shallow(from_hf_dict({**llama, "num_hidden_layers": first}, "llama"), setup) is None
    deep = from_hf_dict({**llama, "num_hidden_layers": first + 1}, "llama")
    assert depth.shallow(deep, setup) == ("num_hidden_layers", first + 1)
    assert depth.shallow(deep, setup.replace(frozen=("model.embed_tokens.*",))) is None
    assert depth.shallow(deep, setup.replace(checkpointing="every-k", checkpoint_every_k=2)) is None


def test_gemm_scratchpads_are_kept_on_disk(tmp_path, monkeypatch):
    """A measured scratchpad is written to the disk cache under this machine's key and read back in a process
    that has not measured it (here: the in-memory table cleared, probing refused)."""
    sig = ("aten::mm.out", (((64, 192), (192, 1), "torch.bfloat16"), ((192, 64), (64, 1), "torch.bfloat16"),
                            ((64, 64), (64, 1), "torch.bfloat16")), (), ())
    path = tmp_path / "cache.json"
    monkeypatch.setenv(workspace.CACHE_ENV, str(path))
    monkeypatch.setattr(workspace, "_MEASURED", {})
    monkeypatch.setattr(workspace, "_DISK", {})
    monkeypatch.setattr(workspace, "_PENDING", {})
    measured = workspace.measure(sig, 1)
    assert measured == workspace._probe(workspace._key(sig, 1))
    on_disk = json.loads(path.read_text())
    assert on_disk == {workspace.machine(): {repr(workspace._key(sig, 1)): measured}}

    def refuse(key):
        raise AssertionError("probed again")

    monkeypatch.setattr(workspace, "_MEASURED", {})
    monkeypatch.setattr(workspace, "_DISK", {})
    monkeypatch.setattr(workspace, "_probe", refuse)
    assert workspace.measure(sig, 1) == measured
    fp32 = (sig[0], tuple((size, stride, "torch.float32") for size, stride, _ in sig[1]), (), ())
    assert not workspace.probed(fp32) and workspace.measure(fp32, 1) == 0  # MKL/BLAS: nothing of torch's allocator
