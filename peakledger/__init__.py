"""peakledger: where the memory of a training step goes, moment by moment.

    from peakledger import build_scenario, run
    report = run(build_scenario({"preset": "gpt2"}, {"micro_batch": 8}))
    print(report.peaks.overall.bytes)

    # any HF model type, or your own module, traced on fake tensors
    report = run(trace(hf_config="config.json", micro_batch=4, seq_len=2048, precision="bf16-mixed"))

    # before any model: a compute plan, and the batches a memory budget allows
    plan(["5e7", "1B"], compute="6e16", tokens_per_s=1e5)   # frozen dataclass; .as_json()
    batch_range(fixed=100, per_sample=30, budget=200).feasible_range   # (1, 3)
"""

from .api import batch_range, fixed_state_peak, max_micro_batch, plan, run, trace
from .diagnosis import explain
from .scenario import Scenario, build_scenario

__all__ = ["Scenario", "build_scenario", "run", "trace", "explain", "max_micro_batch", "fixed_state_peak",
           "batch_range", "plan"]
