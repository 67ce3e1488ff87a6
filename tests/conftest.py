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
