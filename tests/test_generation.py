"""Generation and evaluation inside training (issue 40): HF `generate` split into its phases with its KV cache, and
HF Trainer's evaluation keeping its logits, each predicted on fake tensors and held against the same script run
for real on the CPU under the tracker (peakledger run). The KV cache and the accumulated logits are also worked out
here by hand from the scripts' configs (examples/scripts/hf_generate.py, hf_trainer_eval.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from validate_generation import kv_peak  # bench/: KV_CACHE bytes live at once within a phase

from peakledger.analysis.explain import cause
from peakledger.analysis.validate import compare_logs
from peakledger.models.script.child import in_children
from peakledger.script import ScriptRun, predict_script
from peakledger.simulator.events import Action, Block, Category, Event, Phase, Stream
from peakledger.traces.script_run import measure_script
from tests.cli_run import cli

SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "scripts"
GEN, EVAL = SCRIPTS / "hf_generate.py", SCRIPTS / "hf_trainer_eval.py"
LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 512  # the scripts' tiny Llama


def both(script: Path, args: list[str]):
    """(prediction's log, measured log): the script on fake tensors, simulated, and run for real under the tracker."""
    report, _ = predict_script(ScriptRun(str(script), tuple(args), steps=None))
    (measured,) = in_children([(measure_script, (script, args, None, None, 1, 0, 1, 29561))])
    return report.log, measured


def agree(predicted, measured) -> set[Phase]:
    v = compare_logs(measured, predicted)
    assert v.overall.measured > 0 and abs(v.overall.error) <= 0.005
    for p in v.phases:
        assert abs(p.error) <= 0.005, p.label
    return {e.phase for e in predicted.events}


def test_generate_dynamic_greedy_agrees_with_its_real_run_and_its_cache_grows_by_concatenation():
    p, n, prompts = 6, 4, 2
    predicted, measured = both(GEN, ["--train-steps", "1", "--micro-batch", "1", "--prompts", str(prompts),
                                     "--prompt-len", str(p), "--max-new-tokens", str(n), "--seq-len", "8"])
    assert {Phase.FORWARD, Phase.OPTIMIZER, Phase.GENERATE, Phase.PREFILL, Phase.DECODE} <= agree(predicted, measured)
    token = prompts * KV_HEADS * HEAD_DIM * 4  # one layer's keys for one token, fp32
    # the last decode step: every layer holds p + n - 1 tokens, and torch.cat's old values (p + n - 2) live a moment
    want = LAYERS * 2 * token * (p + n - 1) + token * (p + n - 2)
    assert kv_peak(predicted, Phase.DECODE) == kv_peak(measured, Phase.DECODE) == want
    assert kv_peak(predicted, Phase.PREFILL) == LAYERS * 2 * token * p


def test_generate_static_sampling_with_several_sequences_agrees_and_preallocates_max_length():
    p, n, prompts, seqs = 6, 4, 1, 3
    predicted, measured = both(GEN, ["--train-steps", "0", "--prompts", str(prompts), "--prompt-len", str(p),
                                     "--max-new-tokens", str(n), "--cache", "static", "--do-sample",
                                     "--num-return-sequences", str(seqs)])
    agree(predicted, measured)
    # StaticCache: max_cache_len = max_length - 1 for every expanded row, allocated at the prefill's first update
    want = LAYERS * 2 * prompts * seqs * KV_HEADS * HEAD_DIM * 4 * (p + n - 1)
    assert (kv_peak(predicted, Phase.PREFILL) == kv_peak(predicted, Phase.DECODE) == kv_peak(measured, Phase.DECODE)
            == want)


@pytest.mark.parametrize("accumulation", [0, 2])
def test_trainer_evaluate_keeps_the_logits_until_eval_accumulation_steps(accumulation):
    batches, batch, seq = 4, 2, 8
    predicted, measured = both(EVAL, ["--max-steps", "0", "--eval-batches", str(batches), "--eval-batch", str(batch),
                                      "--seq-len", str(seq), "--eval-accumulation-steps", str(accumulation)])
    assert Phase.EVAL in agree(predicted, measured)
    largest = max(e.block.nbytes for e in predicted.events if e.block.category is Category.PREDICTIONS)
    kept = accumulation or batches  # batches of logits concatenated on the device before they go to numpy
    assert largest == kept * batch * seq * VOCAB * 4
    assert largest == max(e.block.nbytes for e in measured.events if e.block.category is Category.PREDICTIONS)


def test_run_reports_the_generation_phases_and_the_kv_cache():
    args = ["--", "--train-steps", "0", "--prompt-len", "4", "--max-new-tokens", "2"]
    rc, text, err = cli("run", str(GEN), *args)
    assert rc == 0, err
    assert "step 0 prefill" in text and "step 0 decode" in text and "kv_cache" in text


def test_the_why_of_a_moment_names_the_kv_cache_and_the_accumulated_predictions():
    kv = Block(1, 4096, Category.KV_CACHE, "kv_cache.layers.0.keys", "fp32")
    at = Event(1, 0.0, Action.ALLOC, kv, Phase.DECODE, 1, -1, Stream.COMPUTE, "cat")
    assert "the KV cache (8,192 B now)" in cause(at, {Category.KV_CACHE: 8192})
    logits = Block(2, 1024, Category.PREDICTIONS, "eval.accumulated", "fp32")
    at = Event(2, 0.0, Action.ALLOC, logits, Phase.EVAL, 1, -1, Stream.COMPUTE, "cat")
    assert "eval_accumulation_steps" in cause(at, {Category.PREDICTIONS: 1024})
