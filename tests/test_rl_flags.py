"""The flag-level GRPO scenario (models/rl.py): a 7B-class policy's reference model and colocated vLLM engine, each
figure worked out here from Qwen2.5-7B's config, vLLM 0.32.0's rules (docs/rl.md) and TRL's loop."""

from __future__ import annotations

import math

import pytest

from peakledger import api
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.simulator.events import Phase

# Qwen2.5-7B: hidden, layers, MLP, vocab (untied), query heads, key-value heads, head size
H, L, FF, V, KV, HD = 3584, 28, 18944, 152064, 4, 128
N_PARAMS = 2 * V * H + L * (2 * H * H + H + 2 * (H * KV * HD + KV * HD) + 3 * H * FF + 2 * H) + H
TOTAL = 85_017_755_648  # H100-80GB
BASE = dict(precision="bf16", optimizer_impl="fused", micro_batch=4, grad_accum=4, seq_len=1536,
            checkpointing="full", rl="grpo", num_generations=8, max_completion_length=1024, rl_beta=0.04,
            vllm="colocate", vllm_sleep_level=1)


def run(**changes):
    from peakledger.cli import build_parser
    from peakledger.inputs import scenario_from_args

    argv = ["simulate", "--preset", "qwen2.5-7b", "--describer", "hand-written"]
    for k, v in {**BASE, **changes}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)] if not isinstance(v, bool) else [f"--{k.replace('_', '-')}"]
    scenario = scenario_from_args(build_parser().parse_args(argv))
    report = api.run(scenario)
    return {(p.step, p.phase): p.allocated for p in report.phases}


def test_grpo_rollout_holds_the_reference_and_the_woken_engine():
    base, offloaded = run(), run(offload_reference=True)
    rollout = (2, Phase.ROLLOUT)
    # the reference model (bf16, as the policy) leaves the device: the rollout's peak drops by its weights exactly
    assert base[rollout] - offloaded[rollout] == 2 * N_PARAMS


def test_rl_knobs_refused_with_the_knob_named():
    with pytest.raises(ConfigError, match="num_generations"):
        TrainingSetup(**{**BASE, "num_generations": 3})
    with pytest.raises(ConfigError, match="vllm_sleep_level"):
        TrainingSetup(**{**BASE, "vllm": "none"})
    with pytest.raises(ConfigError, match="rl"):
        TrainingSetup(vllm="colocate")
    with pytest.raises(ConfigError, match="max_completion_length"):
        TrainingSetup(**{**BASE, "max_completion_length": 1536})
    assert math.ceil(TOTAL * 0.3) == 25_505_326_695  # vLLM's request_memory (docs/rl.md's example)


def test_explain_combines_offloading_the_reference_with_expandable_segments():
    """docs/rl.md's 7B run: no RL fix fits alone, offloading the reference with expandable segments does; explain
    combines the rollout's fixes with the allocator's (diagnosis._combine, the two candidates only here)."""
    from peakledger.cli import build_parser
    from peakledger.diagnosis import _combine, _fix
    from peakledger.fixes import allocator_fixes, rl_fixes
    from peakledger.inputs import scenario_from_args

    argv = ["simulate", "--preset", "qwen2.5-7b", "--describer", "hand-written"]
    for k, v in BASE.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    sc = scenario_from_args(build_parser().parse_args(argv))
    budget = 85_017_755_648
    wanted = ("offload the reference model", "allocator: expandable_segments:True")
    candidates = [c for c in rl_fixes(sc) + allocator_fixes(sc) if c[0] in wanted]
    singles = [_fix(sc, budget, *c) for c in candidates]
    assert [f.name for f in singles] == list(wanted) and not any(f.fits for f in singles)
    both = _combine(sc, budget, candidates, singles)
    assert both.name == " + ".join(wanted) and both.fits
    assert both.changes == {"offload_reference": True, "alloc_conf": "expandable_segments:True"}
