"""compare --peers: DeepSpeed's column from DeepSpeed's own estimators when deepspeed imports (its version printed),
else 0.19.8's formulas, labelled; a ZeRO stage peaking above the one before it explained from the event log."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest
from tables import cell_equals

from peakledger.analysis.peers import DEEPSPEED_FORMULA_VERSION, deepspeed_estimators, peak_difference
from peakledger.cli import main
from peakledger.simulator.events import Action, Block, Category, Event, Phase, Stream

LLAMA3_8B = ["--preset", "llama-3-8b", "--world-size", "8"]
PSI = 8_030_261_248  # Meta's published Llama-3-8B parameter count
EMBED = 128_256 * 4_096  # its largest layer: embed_tokens (and the untied lm_head), vocabulary x hidden


def _peers(capsys, *extra):
    assert main(["compare", *LLAMA3_8B, "--peers", *extra]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in extra else out


def test_the_column_is_deepspeeds_own_estimator(capsys):
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    # a fresh process, deepspeed not imported yet: stdout is the JSON alone (the import's warning is silenced)
    run = subprocess.run([sys.executable, "-c", "import sys; from peakledger.cli import main; sys.exit(main())",
                          "compare", *LLAMA3_8B, "--peers", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    stages = {r["stage"]: r for r in out["peers"]}
    assert stages[2]["n_params"] == PSI and stages[3]["largest_layer_params"] == EMBED
    _, zero2 = estimate_zero2_model_states_mem_needs(PSI, num_gpus_per_node=8, num_nodes=1, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(PSI, EMBED, num_gpus_per_node=8, num_nodes=1,
                                                        cpu_offload=False, cpu_offload_params=False)
    assert stages[2]["deepspeed_estimate"] == zero2 and stages[3]["deepspeed_estimate"] == zero3
    assert stages[2]["deepspeed_own"] is True and stages[2]["deepspeed_version"] == deepspeed.__version__
    text = _peers(capsys)
    assert f"DeepSpeed est.: DeepSpeed {deepspeed.__version__}, its own estimate_zero2_model_states_mem_needs" in text
    if deepspeed.__version__ == "0.19.8":  # the figure: 0.19.8 prints 31.78 GB (GiB) per GPU for ZeRO-2
        assert f"{zero2 / 2**30:.2f}" == "31.78"


def test_without_deepspeed_the_formulas_say_their_version(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails as if not installed
    est = deepspeed_estimators()
    assert not est.own and est.version == DEEPSPEED_FORMULA_VERSION == "0.19.8"
    out = _peers(capsys, "--json")
    stages = {r["stage"]: r for r in out["peers"]}
    # deepspeed/runtime/zero/stage_1_and_2.py 0.19.8: 2 P + int(18 P / N); stage3.py: 4 x largest + int(18 P / N)
    assert stages[2]["deepspeed_estimate"] == 2 * PSI + 18 * PSI // 8 == 34_128_610_304
    assert stages[3]["deepspeed_estimate"] == 4 * EMBED + 18 * PSI // 8
    assert stages[0]["deepspeed_estimate"] is None and stages[1]["deepspeed_estimate"] is None
    text = _peers(capsys)
    assert "DeepSpeed est.: DeepSpeed 0.19.8's formulas (deepspeed not installed)" in text
    unit = re.search(r"\(bytes per rank; (\w+)\)", text).group(1)
    zero2 = text.splitlines()[4].split()
    assert zero2[0] == "ZeRO-2" and cell_equals(zero2[4], 34_128_610_304, unit)  # the old 4P + 16P/N: 44.87 GiB



def test_a_deepspeed_that_does_not_import_is_said(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))  # imports, but is not the package
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.stage3", None)
    est = deepspeed_estimators()
    assert not est.own and est.source == ("DeepSpeed 0.19.8's formulas (deepspeed did not import: import of "
                                          "deepspeed.runtime.zero.stage3 halted; None in sys.modules)")
    assert est.zero2(PSI, 8) == 2 * PSI + 18 * PSI // 8

def test_zero2_above_zero1_is_explained_by_what_it_holds(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    stages = {r["stage"]: r for r in _peers(capsys, "--json")["peers"]}
    assert stages[2]["peak"] > stages[1]["peak"]
    assert "above_previous" not in stages[1] and "above_previous" not in stages[3]  # 0 > 1 and 2 > 3
    d = stages[2]["above_previous"]
    assert d["moment"] == d["other_moment"] and d["moment"]["phase"] == "backward" and d["moment"]["step"] == 2
    by = {c["category"]: c for c in d["categories"]}
    assert set(by) == {"gradient", "reduce_scatter_bucket"}
    # the bf16 gradient partition: P / 8 elements (P divides by 8 x 2) x 2 bytes; the ipg bucket: DeepSpeed's
    # reduce_bucket_size default, 5e8 elements (deepspeed/runtime/zero/config.py 0.19.8) x 2 bytes
    assert (by["gradient"]["bytes"], by["gradient"]["other_bytes"]) == (PSI // 8 * 2, 0)
    assert (by["reduce_scatter_bucket"]["bytes"], by["reduce_scatter_bucket"]["other_bytes"]) == (10**9, 0)
    assert [b["name"] for b in by["gradient"]["blocks"]] == ["deepspeed.grad_partition"]
    assert [b["name"] for b in by["reduce_scatter_bucket"]["blocks"]] == ["deepspeed.ipg_bucket"]
    assert all(b["allocated"]["step"] == 1 for c in by.values() for b in c["blocks"])  # kept since step 1
    assert stages[2]["peak"] - stages[1]["peak"] == PSI // 8 * 2 + 10**9
    text = _peers(capsys)
    gib = 2**30  # the text's figures are the JSON's peaks, in GiB (2 decimals; the gap 4 significant digits)
    assert (f"ZeRO-2 peaks above ZeRO-1 ({stages[2]['peak'] / gib:.2f} GiB vs {stages[1]['peak'] / gib:.2f} GiB, "
            f"+{(PSI // 8 * 2 + 10**9) / gib:.3f} GiB): both peak at rank 0, step 2 backward") in text
    assert "more gradient: 1.87 GiB vs 0 GiB: deepspeed.grad_partition 1.87 GiB (allocated at step 1" in text


def _alloc(i, name, nbytes, category, step=1):
    block = Block(id=i, nbytes=nbytes, category=category, name=name, dtype="bf16")
    return Event(seq=i, time=float(i), action=Action.ALLOC, block=block, phase=Phase.BACKWARD, step=step,
                 micro_batch_index=0, stream=Stream.COMPUTE, op=f"op{i}")


def test_peak_difference_by_category_and_block():
    same = [_alloc(1, "w", 100, Category.PARAMETER)]
    higher = same + [_alloc(2, "g", 40, Category.GRADIENT), _alloc(3, "a.x", 30, Category.ACTIVATION),
                     _alloc(4, "a.y", 5, Category.ACTIVATION)]
    lower = same + [_alloc(5, "a.x", 10, Category.ACTIVATION), _alloc(6, "t", 7, Category.TEMPORARY, step=2)]
    rows = peak_difference(higher, lower, names=1)
    assert [(r["category"], r["bytes"], r["other_bytes"]) for r in rows] == [
        ("gradient", 40, 0), ("activation", 35, 10), ("temporary", 0, 7)]  # the parameter, equal, is not a row
    assert rows[1]["blocks"] == [{"name": "a.x", "bytes": 20, "allocated": {"step": 1, "phase": "backward",
                                                                            "op": "op3"}}]
    assert rows[1]["more_blocks"] == 1  # a.y
    assert rows[2]["blocks"][0]["name"] == "t" and rows[2]["blocks"][0]["allocated"]["step"] == 2


def test_the_accelerate_column_is_its_own_estimate_memory(capsys):
    accelerate = pytest.importorskip("accelerate")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    # Meta's Llama-3-8B config, built as `accelerate estimate-memory` builds a transformers model (its
    # create_empty_model: AutoModel.from_config in fp32 under init_empty_weights), sized by its own functions; the
    # "Training using Adam" figure is the largest of estimate_training_usage's terms (its estimate_command)
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192, tie_word_embeddings=False)
    with init_empty_weights():
        model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    total, _ = calculate_maximum_sizes(model)
    # AutoModel is the base model: Llama-3-8B without its LM head, plus its (fp32 rotary) buffers
    assert total == 4 * (PSI - EMBED) + 4 * sum(b.numel() for b in model.buffers())
    expected = max(estimate_training_usage(total, "bfloat16").values())  # bf16-mixed: compare's default precision
    stages = {r["stage"]: r for r in _peers(capsys, "--json")["peers"]}
    assert stages[0]["accelerate_estimate"] == expected == 2 * total  # Adam's two fp32 states, the largest term
    assert all(stages[s]["accelerate_estimate"] is None for s in (1, 2, 3))  # it shards nothing: ZeRO-0 only
    assert stages[0]["accelerate_own"] is True and stages[0]["accelerate_version"] == accelerate.__version__
    assert stages[0]["accelerate_detail"]["model_class"] == "LlamaModel"
    text = _peers(capsys)
    assert (f"accelerate: accelerate {accelerate.__version__}, its own calculate_maximum_sizes + "
            "estimate_training_usage") in text
    unit = re.search(r"\(bytes per rank; (\w+)\)", text).group(1)
    zero0 = text.splitlines()[2].split()
    assert zero0[0] == "ZeRO-0" and cell_equals(zero0[5], expected, unit)  # the accelerate column


def test_without_accelerate_its_formula_says_its_version(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # `import accelerate` now fails as if not installed
    stages = {r["stage"]: r for r in _peers(capsys, "--json")["peers"]}
    # accelerate/commands/estimate.py 1.16.0 estimate_training_usage, 16-bit mixed precision over S = 4 B x P:
    # model S, gradients 1.5 S, optimizer 2 S, step 2 S; the figure is the largest, 2 S
    assert stages[0]["accelerate_estimate"] == 2 * 4 * PSI
    assert (stages[0]["accelerate_own"], stages[0]["accelerate_version"]) == (False, "1.16.0")
    assert stages[0]["accelerate_source"].startswith("accelerate 1.16.0's formulas (accelerate not installed)")
    assert "accelerate: accelerate 1.16.0's formulas (accelerate not installed)" in _peers(capsys)
