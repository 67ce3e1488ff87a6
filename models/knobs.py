"""A training knob and the section that holds it.

`TrainingSetup` (models/config/setup.py) is made of sections, one frozen object per concern (the batch, the
loop, precision, the optimizer, activation checkpointing, the data-parallel engine, the mesh, checkpoint I/O,
offload, LoRA, MoE, compile), read as `setup.lora.r`. A section's fields are its knobs, each declared once with
`knob(...)`: its default, the group of flags it is shown in, its help, how a command line sets it, and its *name*:
the flag's and the scenario file's `[training]` key (`lora_r`), which is what users write and what every error
names. The CLI's flags (peakledger/cli_common.py `add_setup_flags`), the scenario keys (peakledger/scenario.py)
and the setup's one serialised form (`TrainingSetup.knob_values`) are generated from these declarations.

A field of a section may itself be a section (the data-parallel section holds each engine's knob class,
declared with its engine in models/dp_engines.py); a field without a knob is derived (a precision's dtypes).
A section has no truth value and never equals a string: `if setup.compile:`, or `setup.precision` compared with
a name, raise where a bare flag was once read.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

FLAG_GROUPS = {  # group -> the title of its flags in --help, in --help order
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
    "float8": "float8 training (torchao Float8Linear)",
    "rl": "RL post-training (TRL GRPO: reference model, rollout with HF generate or a colocated vLLM engine)",
}
CLI_FORMS = ("value", "on", "off", "append", "none")


@dataclass(frozen=True)
class Knob:
    """How one setup field is named, shown and set. `name`: the knob's name when it is not the field's (`lora_r`
    for `Lora.r`). `cli`: "value" (--name VALUE, typed by the field's annotation; a tuple is a comma-separated
    list), "on" (--name sets true), "off" (--no-name sets false), "append" (--flag PATTERN, repeated, into a
    tuple), "none" (no flag; scenario files only)."""

    group: str
    help: str = ""
    choices: tuple = ()  # the allowed values, listed in the help (checked by the setup, not by argparse)
    flag: str = ""  # the flag's name when it is not --<name> (--no-<name> for "off")
    cli: str = "value"
    hidden: bool = False  # a flag left out of --help (an engine's bucket sizes)
    argparse_choices: bool = False  # argparse checks the value itself (its own one-line error)
    metavar: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.group not in FLAG_GROUPS or self.cli not in CLI_FORMS:
            raise ValueError(f"knob declared with an unknown group {self.group!r} or form {self.cli!r}")

    @property
    def text(self) -> str:
        """The help line: the choices, then what the knob does."""
        if self.choices and not self.argparse_choices:  # (argparse lists its own)
            return ", ".join(map(str, self.choices)) + (f" ({self.help})" if self.help else "")
        return self.help


def knob(default, group: str, help: str = "", **how):
    """A section field with its knob declaration (`Knob` takes the keywords)."""
    return field(default=default, metadata={"knob": Knob(group, help, **how)})


class Section:
    """A frozen part of the setup (subclasses are `@dataclass(frozen=True, eq=False)`): equal to a section of
    its own class with equal fields, hashable, never true or false, never equal to anything else."""

    def _values(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __eq__(self, other) -> bool:
        if isinstance(other, Section):
            return type(self) is type(other) and self._values() == other._values()
        raise TypeError(f"a {type(self).__name__} section compared with {other!r}: compare one of its fields "
                        f"({', '.join(f.name for f in dataclasses.fields(self))})")

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __bool__(self) -> bool:
        raise TypeError(f"a {type(self).__name__} section has no truth value: read one of its fields "
                        f"({', '.join(f.name for f in dataclasses.fields(self))})")

    @classmethod
    def from_knobs(cls, values: dict):
        """This section from knob values by name (each of its knobs must be there)."""
        made = {}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if isinstance(kind, type) and issubclass(kind, Section):
                made[f.name] = kind.from_knobs(values)
            elif "knob" in f.metadata:
                made[f.name] = values[f.metadata["knob"].name or f.name]
        return cls(**made)


@dataclass(frozen=True)
class SetupKnob:
    """One knob of the setup: its `name` (flag and scenario key), the field's type and default, its declaration
    and `path`, the attributes that lead to its value from the setup (("lora", "r"))."""

    name: str
    annotation: object  # the field's type (int, float, str, bool, tuple[int, ...], str | None, ...)
    default: object
    knob: Knob
    path: tuple[str, ...]

    @property
    def flag(self) -> str:
        base = self.knob.flag or self.name.replace("_", "-")
        return f"--no-{base}" if self.knob.cli == "off" else f"--{base}"

    def read(self, setup) -> object:
        value = setup
        for attr in self.path:
            value = getattr(value, attr)
        return value

    def read_from(self, section: Section) -> object:
        """Its value in the setup's section `section` (the first attribute of `path`)."""
        value = section
        for attr in self.path[1:]:
            value = getattr(value, attr)
        return value


def section_knobs(cls, path: tuple[str, ...] = ()) -> list[SetupKnob]:
    """Every knob of the section class `cls` and of the sections it holds, in field order (each field must be
    a section or declare a knob, unless `cls` says its other fields are derived: `DERIVED`)."""
    hints = typing.get_type_hints(cls)
    out: list[SetupKnob] = []
    derived = getattr(cls, "DERIVED", ())
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and issubclass(kind, Section):
            out += section_knobs(kind, (*path, f.name))
            continue
        declared = f.metadata.get("knob")
        if declared is None:
            if f.name in derived:
                continue
            raise TypeError(f"{cls.__name__}.{f.name} declares no knob (models/knobs.py)")
        out.append(SetupKnob(declared.name or f.name, kind, f.default, declared, (*path, f.name)))
    return out


__all__ = ["FLAG_GROUPS", "Knob", "knob", "Section", "SetupKnob", "section_knobs"]
