"""The model-family registry (models/families/): each family has its home and its real program, every preset is
its family's, and the rest of the code asks the family instead of testing a config's class."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.families import FAMILIES, family_of
from peakledger.models.presets import ORDER, PRESETS, preset
from peakledger.traces.reference.build import PROGRAMS

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("simulator", "models", "traces", "analysis", "peakledger")


def test_every_family_has_a_real_program_registered_against_it():
    """traces/reference/build.py keys each program by the family object itself (never by a name)."""
    assert set(PROGRAMS) == set(FAMILIES)


def test_every_preset_is_its_familys_and_hand_written():
    names = [p.name for f in FAMILIES for p in f.presets]
    assert sorted(names) == sorted(PRESETS) and len(set(names)) == len(names)
    assert list(PRESETS)[:len(ORDER)] == list(ORDER)  # the order the CLI lists them in
    for family in FAMILIES:
        for config in family.presets:
            assert family_of(config) is family and family.hand_written and preset(config.name) is config


def test_a_model_no_family_takes_is_refused_naming_the_families():
    with pytest.raises(ConfigError) as e:
        family_of(object())
    assert str(e.value) == f"model: no describer takes a object; families: {', '.join(f.name for f in FAMILIES)}"
    assert [f.name for f in FAMILIES][:5] == ["traced", "mixtral", "hf-gpt2", "nanogpt", "mlp"]  # (the first takes)


def test_each_familys_answers():
    by_name = {f.name: f for f in FAMILIES}
    assert {n for n, f in by_name.items() if f.transformer} == {"mixtral", "hf-gpt2", "nanogpt"}
    assert {n for n, f in by_name.items() if f.experts} == {"mixtral"}
    assert {n: set(f.parallel) for n, f in by_name.items() if f.parallel} == {"mixtral": {"ep"},
                                                                            "nanogpt": {"tp", "pp", "cp"}}
    assert {n for n, f in by_name.items() if not f.layer_search} == {"mixtral", "hf-gpt2"}
    tiny, mlp = preset("tiny"), preset("tiny-mlp")
    assert by_name["nanogpt"].lora_targets(tiny, TrainingSetup(lora_r=8)) == ("c_attn",)
    with pytest.raises(ConfigError) as e:
        by_name["mlp"].lora_targets(mlp, TrainingSetup(lora_r=8))
    assert e.value.field == "lora_r"
    assert by_name["nanogpt"].seq_len(tiny) == 64 and by_name["mlp"].seq_len is None


MODEL_CLASS = re.compile(r"isinstance\([^)]*(TransformerConfig|MLPConfig)")


def test_no_code_tests_a_model_config_class_outside_the_family_homes():
    """`isinstance(x, TransformerConfig)` / `isinstance(x, MLPConfig)` is a question for the model's family
    (`family_of(x).transformer`, `.experts`, `.parallel`, ...); only a family's `takes` asks the class."""
    found = sorted(f"{path.relative_to(REPO)}:{n}" for layer in LAYERS for path in (REPO / layer).rglob("*.py")
                   if "families" not in path.relative_to(REPO).parts
                   for n, line in enumerate(path.read_text().splitlines(), 1) if MODEL_CLASS.search(line))
    assert found == []
