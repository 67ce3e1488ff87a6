"""peakledger: where the memory of a training step goes, moment by moment.

    from peakledger import build_scenario, run
    report = run(build_scenario({"preset": "gpt2"}, {"micro_batch": 8}))
    print(report.peaks.peak.bytes)
"""

from .api import fixed_state_peak, max_micro_batch, run
from .scenario import Scenario, build_scenario

__all__ = ["Scenario", "build_scenario", "run", "max_micro_batch", "fixed_state_peak"]
