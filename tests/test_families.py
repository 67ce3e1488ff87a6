"""The model-family registry (models/families.py): every preset is taken by a hand-written family, and each
hand-written family has its real program on the measuring side (traces/reference/build.py PROGRAMS), so every
family can be validated against a real run."""

from __future__ import annotations

from peakledger.models.families import FAMILIES, family_of
from peakledger.models.presets import PRESETS, preset
from peakledger.traces.reference.build import PROGRAMS


def test_every_hand_written_family_has_a_real_program():
    assert {f.name for f in FAMILIES if f.hand_written} == set(PROGRAMS)


def test_every_preset_is_taken_by_a_hand_written_family():
    for name in PRESETS:
        assert family_of(preset(name)).hand_written

