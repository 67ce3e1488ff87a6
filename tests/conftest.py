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
