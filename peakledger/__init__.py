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

from __future__ import annotations

import importlib
import sys
import types

# name -> the module that defines it, imported when the name is first read (PEP 562): the `peakledger` command
# (peakledger/launch.py) imports this package before it knows whether a server runs the command
_WHERE = {"Scenario": ".scenario", "build_scenario": ".scenario", "run": ".api", "trace": ".api",
          "explain": ".diagnosis", "max_micro_batch": ".api", "fixed_state_peak": ".api", "batch_range": ".api",
          "plan": ".api"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'peakledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """`peakledger.plan` is the API's function, as when this file imported it eagerly, also once the submodule
    peakledger/plan.py is imported (the import system sets a package's attribute to each submodule it loads)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
