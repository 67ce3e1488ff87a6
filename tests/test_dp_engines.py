"""The data-parallel engine registry (models/dp_engines.py): every entry names an Engine the describer builds, the
setup check and the CLI take their names and knob rules from it, models/parallel's `ENGINES` holds each one's class,
and an engine added there (one module, a line in each) is simulated and its knobs checked with no other edit."""

from __future__ import annotations

import pytest

from peakledger.models import dp_engines
from peakledger.models.config import DP_ENGINES, KNOB_APPLIES, KNOBS, ConfigError, TrainingSetup, check_given_knobs
from peakledger.models.dp_engines import DpEngine
from peakledger.models.knobs import section_knobs
from peakledger.models.parallel import DDP, ENGINES, Engine
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate


def test_every_entry_builds_its_engine_and_the_setup_takes_its_names():
    assert DP_ENGINES == tuple(dp_engines.DP_ENGINES) == tuple(ENGINES)  # the two registries name the same
    for e in dp_engines.DP_ENGINES.values():
        assert callable(ENGINES[e.name])
        assert not isinstance(ENGINES[e.name], str)  # a direct reference, not a path resolved at run time
        for knob in section_knobs(e.knobs):
            assert knob.name in KNOBS and knob.name not in KNOB_APPLIES
            assert knob.name in dp_engines.knob_rules() or knob.name in e.unchecked


@pytest.mark.parametrize("engine", DP_ENGINES)
def test_make_engine_gives_the_engine_the_setup_names(engine):
    setup = TrainingSetup(micro_batch=2, seq_len=16, world_size=2, dp_engine=engine)
    graph = describe(preset("tiny"), setup, "H100-80GB")
    assert graph.metadata.setup.data_parallel.engine == engine


def test_an_engine_registered_in_one_line_is_simulated_and_its_knobs_checked(monkeypatch):
    """The throwaway engine of issue 24's count: DDP under another name, registered by one line in each registry."""
    monkeypatch.setitem(dp_engines.DP_ENGINES, "ddp-copy",
                        DpEngine("ddp-copy", "DDP again", dp_engines.DdpKnobs))
    monkeypatch.setitem(ENGINES, "ddp-copy", DDP)
    assert issubclass(ENGINES["ddp-copy"], Engine)
    kw = dict(micro_batch=2, seq_len=16, world_size=2, ddp_bucket_cap_mb=1)
    copy, ddp = TrainingSetup(dp_engine="ddp-copy", **kw), TrainingSetup(dp_engine="ddp", **kw)
    check_given_knobs(copy, {"ddp_bucket_cap_mb"})
    a, b = (simulate(describe(preset("tiny"), s, "H100-80GB")) for s in (copy, ddp))
    assert [(e.action, e.block.nbytes, e.op) for e in a.events] == [(e.action, e.block.nbytes, e.op) for e in b.events]
    with pytest.raises(ConfigError, match="dp_engine ddp or zero-redundancy-optimizer or ddp-copy"):
        check_given_knobs(TrainingSetup(dp_engine="fsdp2", **kw), {"ddp_bucket_cap_mb"})
