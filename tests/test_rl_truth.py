"""Facts about TRL's DPO and GRPO trainers' real CPU runs (traces/reference/trl_run.py), each against a formula from
the tiny model's config and TRL 1.16.0's source (docs/rl.md), not against the simulator."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("trl", "datasets")),
                                reason="needs trl and datasets")

from peakledger.simulator.events import Action, Category  # noqa: E402

# examples/scripts/trl_rl.py's tiny Qwen2 (the tokenizer's 500 tokens)
V, H, FF, L, KV, HD = 500, 64, 128, 2, 2, 16  # vocab, hidden, MLP, layers, key-value heads, head dim
# trl/kernels/chunked_logprob.py: TOKEN_CHUNK_SIZE, trl/trainer/utils.py: _CHUNKED_LOGPROB_CHUNK_SIZE
TOKEN_TILE, VOCAB_TILE = 4096, 32768
B, P, C, G = 2, 8, 8, 2  # TrlCase defaults: micro-batch, prompt and completion tokens, generations


def parameter_bytes() -> int:
    attn = H * H + H + 2 * (H * KV * HD + KV * HD) + H * H  # q, k, v with biases (Qwen2), o without
    layer = attn + 3 * H * FF + 2 * H  # gate / up / down, two RMSNorms
    return 4 * (V * H + L * layer + H + V * H)  # embeddings, layers, final norm, untied lm_head; fp32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from peakledger.traces.reference.trl_run import make_model

    path = str(tmp_path_factory.mktemp("rl") / "tiny-qwen2")
    make_model(path)
    return path


@pytest.fixture(scope="module")
def runs(folder):
    from peakledger.traces.reference.trl_run import TrlCase, measure

    return {name: measure(TrlCase(name), folder) for name in ("dpo", "grpo")}


def _allocs(run, label, step=None):
    return [e.block for e, lab, s in zip(run.log.events, run.labels, run.steps)
            if e.action is Action.ALLOC and lab == label and (step is None or s == step)]


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_policy_and_reference_are_held_in_every_phase(runs, trainer):
    run = runs[trainer]
    assert run.facts["policy"]["parameters"] == run.facts["ref"]["parameters"] == parameter_bytes()
    for label, step in run.phase_peaks():
        if label != "load":
            assert run.live_by_category(label, step)[Category.PARAMETER] == 2 * parameter_bytes(), (label, step)


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_adamw_states_live_from_the_first_step_on(runs, trainer):
    run = runs[trainer]
    first = "update.forward" if trainer == "dpo" else "rollout.generate"
    # exp_avg and exp_avg_sq of the policy only (the reference is frozen), plus a 4-byte step per parameter tensor
    assert Category.OPTIMIZER_STATE not in run.live_by_category(first, 1)
    assert run.live_by_category(first, 2)[Category.OPTIMIZER_STATE] == 2 * parameter_bytes() + 4 * 27


def test_dpo_concatenates_chosen_and_rejected(runs):
    # DataCollatorForPreference: prompt+chosen rows then prompt+rejected rows, each completion with TRL's EOS
    assert runs["dpo"].facts["dpo_input_ids"] == [2 * B, P + C + 1]
    assert {lab for lab, _ in runs["dpo"].phase_peaks()} >= {"update.forward", "update.ref_forward",
                                                            "update.backward"}


def test_the_fused_lm_head_holds_one_tile_not_the_logits(runs):
    # add_fused_lm_head: off CUDA every position but the last is scored (compact=False), N = rows x (T - 1); one
    # [min(N, 4096), 32768] buffer per call (forward, and again in backward), whatever the vocabulary
    for run, n, labels in ((runs["dpo"], 2 * B * (P + C), ("update.forward", "update.ref_forward", "update.backward")),
                           (runs["grpo"], B * (P + C - 1), ("rollout.ref_logprobs", "update.forward",
                                                             "update.backward"))):
        tile = min(n, TOKEN_TILE) * VOCAB_TILE * 4
        for label in labels:
            blocks = _allocs(run, label, 1)
            assert max(b.nbytes for b in blocks) == tile, label
            assert sum(b.nbytes == tile for b in blocks) == 1, label
            assert not any(b.shape[-1:] == (V,) and len(b.shape) == 3 for b in blocks), label  # no (rows, T, V)


def test_grpo_generate_grows_a_dynamic_kv_cache(runs):
    # DynamicCache: each decode step cats one position onto every layer's keys and values; the last growth is
    # (completions, kv heads, prompt + completion - 1, head_dim), once per layer for K and for V
    cats = [b.shape for b in _allocs(runs["grpo"], "rollout.generate", 1)]
    assert cats.count((B, KV, P + C - 1, HD)) == 2 * L
    assert (B, KV, P + C, HD) not in cats


def test_grpo_keeps_the_generation_batch_until_the_next_one(runs):
    # _prepare_inputs buffers the shuffled generation batch (_buffered_inputs): its reference log-probs, (B, C) fp32,
    # live through the update and the next rollout, freed when the next batch replaces the buffer
    run = runs["grpo"]
    born: dict[int, tuple[str, int]] = {}
    held = []
    for e, lab, s in zip(run.log.events, run.labels, run.steps):
        if e.action is Action.ALLOC:
            born[e.block.id] = (lab, s)
        elif born[e.block.id] == ("rollout.score", 1) and e.block.shape == (B, C) and e.block.dtype == "fp32":
            held.append((lab, s))
    assert held == [("rollout.score", 2)]
    assert run.facts["buffer"] == [{"prompt_ids": [B, P], "prompt_mask": [B, P], "completion_ids": [B, C],
                                    "completion_mask": [B, C], "advantages": [B], "ref_per_token_logps": [B, C]}]


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_peakledger_run_names_the_rl_phases_itself(runs, folder, trainer):
    # peakledger run's own phases (models/script/phases.py wraps TRL's methods), no alignment: every RL phase the
    # real run's independent labels give (traces/reference/trl_run.py) has the same peak within 0.5%
    import sys
    from pathlib import Path

    from peakledger.script import ScriptRun, predict_script
    from peakledger.simulator.events import Phase
    from peakledger.traces.reference.trl_run import SCRIPT, TrlCase, label_peaks

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from rl_truth import phase_peaks

    run = runs[trainer]
    case = TrlCase(trainer)
    report, _ = predict_script(ScriptRun(str(SCRIPT), tuple(case.argv(folder)), steps=case.steps))
    predicted = phase_peaks(report.log.events)
    measured = label_peaks(run.log.events, list(run.labels), list(run.steps))
    names = {"dpo": {"update.ref_forward": Phase.REFERENCE},
             "grpo": {"rollout.generate": Phase.GENERATE, "rollout.ref_logprobs": Phase.REFERENCE}}[trainer]
    for step in (1, 2):
        for label, phase in names.items():
            truth = measured[(label, step)]
            assert abs(predicted[(phase, step)] - truth) <= 0.005 * truth, (label, step)
    if trainer == "grpo":  # the rollout's own work (padding, reward, advantages, the buffer split)
        truth = max(measured[("rollout.score", 2)], measured[("rollout.reward", 2)])
        assert abs(predicted[(Phase.ROLLOUT, 2)] - truth) <= 0.005 * truth
    assert report.peaks.overall.bytes == run.peak()
