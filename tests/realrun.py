"""One check shared by the real-run tests: a scenario run for real on the CPU and simulated agree."""

from __future__ import annotations

from peakledger.analysis.validate import static_rows
from peakledger.validation import validate


def assert_matches_real_run(scenario, tolerance: float = 0.01):
    """The whole-run peak and every forward/backward phase peak within `tolerance`, the static rows
    (parameters, gradients, optimizer states) exact. Returns (measured log, simulated log)."""
    v, measured, simulated = validate(scenario)
    assert abs(v.overall.error) <= tolerance, (v.overall, v.unexplained[:3])
    for phase in v.phases:
        if phase.label.startswith(("forward", "backward")):
            assert abs(phase.error) <= tolerance, phase
    assert static_rows(measured) == static_rows(simulated)
    return measured, simulated
