"""A precision name decoded once (models/precision.py): the table agrees with what its names say (a "-mixed" mode keeps
16-bit parameters beside fp32 masters, an "-autocast" mode keeps fp32 parameters and casts the forward to its 16-bit
dtype, pure "bf16" keeps bf16 states too), and TrainingSetup reads every dtype from it."""

from __future__ import annotations

import pytest

from peakledger.models.config import PRECISIONS, TrainingSetup
from peakledger.models.precision import PRECISION_TABLE


@pytest.mark.parametrize("name", PRECISIONS)
def test_each_precision_is_what_its_name_says(name):
    p, half = PRECISION_TABLE[name], name[:4]
    mixed, autocast = name.endswith("-mixed"), name.endswith("-autocast")
    assert p.param == (half if mixed or name == "bf16" else "fp32")
    assert p.compute == ("fp32" if name == "fp32" else half)
    assert p.master == ("fp32" if mixed else None) and p.mixed == mixed
    assert p.state == ("bf16" if name == "bf16" else "fp32")
    assert p.autocast == (half if autocast else None)


@pytest.mark.parametrize("name", PRECISIONS)
def test_the_setup_reads_its_dtypes_from_the_table(name):
    s, p = TrainingSetup(precision=name), PRECISION_TABLE[name]
    assert s.precision == p and s.precision.name == name
    assert s.precision.grad == p.param
