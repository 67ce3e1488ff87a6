import pytest

from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate


@pytest.fixture
def sim():
    def run(model="tiny", device="H100-80GB", **setup):
        cfg = preset(model) if isinstance(model, str) else model
        return simulate(describe(cfg, TrainingSetup(**setup), device))
    return run


@pytest.fixture(autouse=True, scope="session")
def _gemm_scratchpad_cache(tmp_path_factory):
    """The compiled describer's GEMM-scratchpad measurements (models/compile/workspace.py) go to a file of this
    session's, not the user's ~/.cache."""
    import os

    os.environ.setdefault("PEAKLEDGER_GEMM_CACHE", str(tmp_path_factory.mktemp("gemm") / "gemm-scratchpad.json"))


@pytest.fixture(autouse=True, scope="session")
def _trace_cache_off():
    """The disk cache of traces (models/traced/store.py) is off for the suite: tests that empty the per-process
    cache to trace anew must trace, and nothing is written to the user's ~/.cache. tests/test_trace_cache.py turns
    it on, in a folder of its own, where it tests it."""
    import os

    os.environ["PEAKLEDGER_CACHE_DIR"] = "off"


@pytest.fixture(autouse=True, scope="session")
def _no_server():
    """The suite's `peakledger` commands run in their own processes, never on a server the user has up
    (peakledger/serve); tests/test_serve.py starts its own."""
    import os

    os.environ["PEAKLEDGER_SERVER"] = "off"


@pytest.fixture
def trace_disk(tmp_path, monkeypatch):
    """The disk cache of traces on, in a folder of this test's (models/traced/store.py), an empty per-process cache
    (a new process), and every trace in this process; the per-process cache as it was afterwards."""
    import peakledger.models.traced as trace
    from peakledger.models.traced import store

    folder = tmp_path / "traces"
    monkeypatch.setenv(store.DIR_ENV, str(folder))
    monkeypatch.setenv("PEAKLEDGER_FORK", "0")
    saved = (dict(trace._CACHE), set(trace._DERIVED), dict(trace._SHOWN))
    trace.forget()
    yield folder
    trace.forget()
    trace._CACHE.update(saved[0])
    trace._DERIVED.update(saved[1])
    trace._SHOWN.update(saved[2])


@pytest.fixture
def traces_run(monkeypatch):
    """The traces run (each call of models/traced `_trace`), as a list of (layers, micro-batch)."""
    import peakledger.models.traced as trace

    made = []
    real = trace._trace

    def counted(model, setup, target):
        made.append((model.hf_dict().get("num_hidden_layers"), setup.batch.micro_batch))
        return real(model, setup, target)

    monkeypatch.setattr(trace, "_trace", counted)
    return made
