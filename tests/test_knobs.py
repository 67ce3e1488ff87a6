"""The training setup's knobs are declared once (models/config/setup.py) and the CLI's flags and the scenario
file's keys come from that declaration: every knob has its flag in its section's group, and a flag sets its field."""

from __future__ import annotations

import dataclasses

import pytest

from peakledger.cli import build_parser
from peakledger.inputs import given_flags
from peakledger.models.config import FLAG_GROUPS, SETUP_KNOBS, TrainingSetup
from peakledger.models.config.setup import SECTIONS, SERIAL_ORDER
from peakledger.models.knobs import Section, knob, section_knobs
from peakledger.scenario import build_scenario


def _simulate_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["simulate"]


def test_every_knob_has_its_flag_in_its_section_group():
    p = _simulate_parser()
    groups = {g.title: {a.dest for a in g._group_actions} for g in p._action_groups}
    for k in SETUP_KNOBS:
        if k.knob.cli == "none":
            assert all(k.name not in dests for dests in groups.values())
            continue
        assert k.name in groups[FLAG_GROUPS[k.knob.group]], k.name
        assert k.flag in p.format_usage() or k.knob.hidden


@pytest.mark.parametrize("argv, expected", [
    (["--micro-batch", "3", "--seq-len", "64"], {"micro_batch": 3, "seq_len": 64}),
    (["--freeze", "h.0.*", "--freeze", "wte*"], {"frozen": ("h.0.*", "wte*")}),
    (["--no-set-to-none", "--fp32-grads"], {"set_to_none": False, "fp32_grads": True}),
    (["--checkpoint-layers", "0,3", "--lora-targets", "q_proj,v_proj"],
     {"checkpoint_layers": (0, 3), "lora_targets": ("q_proj", "v_proj")}),
    (["--lora-alpha", "16", "--no-reshard-after-forward", "--stage3-prefetch-bucket-size", "7"],
     {"lora_alpha": 16.0, "reshard_after_forward": False, "stage3_prefetch_bucket_size": 7}),
    ([], {}),
])
def test_flags_set_exactly_the_fields_given(argv, expected):
    args = _simulate_parser().parse_args(argv)
    assert given_flags(args)["training"] == expected


def test_scenario_keys_are_the_knobs():
    """A [training] table takes every knob by its field name, and nothing else."""
    values = {"micro_batch": 2, "checkpointing": "full", "dp_engine": "fsdp2", "world_size": 2, "lora_r": 0}
    s = build_scenario({"preset": "tiny"}, values, {"device": "cpu"})
    assert {k: s.setup.knob(k) for k in values} == values
    with pytest.raises(Exception, match="unknown training field"):
        build_scenario({"preset": "tiny"}, {"micro_batches": 2}, {"device": "cpu"})


def test_a_field_without_a_knob_is_refused():
    @dataclasses.dataclass(frozen=True, eq=False)
    class Partial(Section):
        a: int = knob(1, "batch")
        b: int = 2

    with pytest.raises(TypeError, match="Partial.b declares no knob"):
        section_knobs(Partial)
    with pytest.raises(ValueError, match="unknown group"):
        knob(1, "no-such-section")


def test_the_serialised_form_keeps_version_1s_order():
    names = [k.name for k in SETUP_KNOBS]
    assert names[:len(SERIAL_ORDER)] == list(SERIAL_ORDER) and len(set(names)) == len(names)


def test_sections_are_read_by_path_and_built_from_knobs_or_whole():
    setup = TrainingSetup(micro_batch=4, lora_r=8, zero_stage=0, reshard_after_forward=False, fp32_grads=False,
                          precision="bf16-mixed", compile=False)
    assert (setup.batch.micro_batch, setup.lora.r, setup.data_parallel.fsdp2.reshard_after_forward) == (4, 8, False)
    assert (setup.precision.name, setup.precision.param, setup.precision.master) == ("bf16-mixed", "bf16", "fp32")
    assert setup.knob("lora_r") == 8 and setup.knob("dp_engine") == "deepspeed"
    again = TrainingSetup(**{name: getattr(setup, name) for name in SECTIONS})
    assert again == setup and hash(again) == hash(setup)
    assert TrainingSetup.from_knob_values(setup.knob_values()) == setup
    # a knob given with its whole section applies over it; replace keeps what it does not name
    lora = setup.lora
    assert TrainingSetup(lora=lora, lora_r=2).lora.r == 2
    changed = setup.replace(checkpointing="layers", checkpoint_layers=(0, 1))
    assert (changed.checkpointing.policy, changed.checkpointing.layers, changed.lora.r) == ("layers", (0, 1), 8)
    assert changed.replace(checkpointing="none", checkpoint_layers=()).checkpointing == setup.checkpointing


def test_a_section_read_as_a_flag_raises():
    setup = TrainingSetup()
    with pytest.raises(TypeError, match="no truth value"):
        bool(setup.compile)
    with pytest.raises(TypeError, match="compared with 'fp32'"):
        setup.precision == "fp32"  # noqa: B015
    with pytest.raises(AttributeError):
        setup.lora_r  # noqa: B018
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.batch = None
