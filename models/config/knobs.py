"""A training knob: one field of `TrainingSetup`, declared once with its section, its help and how a command line
sets it. The CLI's flags (peakledger/cli_common.py `add_setup_flags`) and the scenario file's [training] keys
(peakledger/scenario.py) are generated from these declarations; nothing lists the knobs a second time.

A section is one concern of the setup (precision and optimizer, activation checkpointing, the data-parallel engine,
the mesh, checkpoint I/O, offload, LoRA / QLoRA, ...): its knobs are declared together in `TrainingSetup`, checked
together (models/config/checks.py), and shown together in `--help`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

SECTIONS = {  # section -> the title of its group of flags, in --help order
    "batch": "training: batch, sequence, steps",
    "precision": "precision and optimizer",
    "checkpointing": "activation checkpointing",
    "data-parallel": "data parallelism: the engine and its knobs",
    "mesh": "model parallelism (world_size = dp x tp x pp x cp)",
    "checkpoint-io": "model load, checkpoint save / load",
    "offload": "optimizer-state offload",
    "lora": "LoRA / QLoRA (peft; the whole base model frozen)",
    "moe": "mixture of experts",
    "compile": "torch.compile (inductor; the CPU program, traced models)",
}
CLI_FORMS = ("value", "on", "off", "append", "none")


@dataclass(frozen=True)
class Knob:
    """How one setup field is shown and set. `cli`: "value" (--name VALUE, typed by the field's annotation; a
    tuple is a comma-separated list), "on" (--name sets true), "off" (--no-name sets false), "append" (--flag
    PATTERN, repeated, into a tuple), "none" (no flag; scenario files only)."""

    section: str
    help: str = ""
    choices: tuple = ()  # the allowed values, listed in the help (checked by the setup, not by argparse)
    flag: str = ""  # the flag's name when it is not --<field-name> (--no-<name> for "off")
    cli: str = "value"
    hidden: bool = False  # a flag left out of --help (an engine's bucket sizes)
    argparse_choices: bool = False  # argparse checks the value itself (its own one-line error)
    metavar: str = ""

    def __post_init__(self) -> None:
        if self.section not in SECTIONS or self.cli not in CLI_FORMS:
            raise ValueError(f"knob declared with an unknown section {self.section!r} or form {self.cli!r}")

    @property
    def text(self) -> str:
        """The help line: the choices, then what the knob does."""
        if self.choices and not self.argparse_choices:  # (argparse lists its own)
            return ", ".join(map(str, self.choices)) + (f" ({self.help})" if self.help else "")
        return self.help


def knob(default, section: str, help: str = "", **how):
    """A `TrainingSetup` field with its knob declaration (`Knob` takes the keywords)."""
    return field(default=default, metadata={"knob": Knob(section, help, **how)})


@dataclass(frozen=True)
class SetupKnob:
    name: str
    annotation: object  # the field's type (int, float, str, bool, tuple[int, ...], str | None, ...)
    default: object
    knob: Knob

    @property
    def flag(self) -> str:
        base = self.knob.flag or self.name.replace("_", "-")
        return f"--no-{base}" if self.knob.cli == "off" else f"--{base}"


def setup_knobs(cls) -> tuple[SetupKnob, ...]:
    """Every knob of the setup class `cls`, in field order (each field must declare one)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("knob")
        if declared is None:
            raise TypeError(f"{cls.__name__}.{f.name} declares no knob (models/config/knobs.py)")
        out.append(SetupKnob(f.name, hints[f.name], f.default, declared))
    return tuple(out)


__all__ = ["SECTIONS", "Knob", "knob", "SetupKnob", "setup_knobs"]
