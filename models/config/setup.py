"""`TrainingSetup`: how the model is trained, made of frozen sections (models/config/sections.py,
models/precision.py, models/dp_engines.py) read as `setup.lora.r`, `setup.precision.param`,
`setup.data_parallel.fsdp2.reshard_after_forward`.

It is built from knobs by name, as users write them (`TrainingSetup(micro_batch=4, lora_r=8)`: the flags and the
scenario file's [training] keys), from whole sections (`TrainingSetup(lora=Lora(r=8))`), or both (knobs apply
over sections); `setup.replace(...)` takes the same. Every knob is type-checked (models/fields.py) and the setup
checked as a whole (models/config/checks.py) before its sections are made, so a bad value is one ConfigError
naming the knob. Its one serialised form is `knob_values()`: every knob by name, in the order stored traces and
`--json` have always had; `from_knob_values` reads it back.
"""

from __future__ import annotations

import dataclasses
import types

from ..dp_engines import DataParallel
from ..fields import check_value
from ..knobs import Section, SetupKnob, section_knobs
from ..precision import PRECISION_TABLE, Precision
from .base import ConfigError
from .checks import check_setup
from .rl import Rl
from .sections import Batch, Checkpointing, CheckpointIO, Compile, Float8, Loop, Lora, Mesh, Moe, Offload, Optimizer

SECTIONS: dict[str, type[Section]] = {
    "batch": Batch, "loop": Loop, "precision": Precision, "optimizer": Optimizer, "checkpointing": Checkpointing,
    "data_parallel": DataParallel, "mesh": Mesh, "checkpoint_io": CheckpointIO, "offload": Offload, "lora": Lora,
    "moe": Moe, "compile": Compile, "float8": Float8, "rl": Rl,
}

# The knobs in the order of the serialised form of version 1 (when the setup was one flat dataclass), so stored
# traces and --json keep their bytes; a knob added since follows them, in the sections' declaration order.
SERIAL_ORDER = (
    "micro_batch", "seq_len", "grad_accum", "steps", "passes", "logits_held", "loop", "precision", "fp32_grads",
    "optimizer", "optimizer_impl", "set_to_none", "frozen", "checkpointing", "checkpoint_every_k", "checkpoint_layers",
    "dp_engine", "zero_stage", "reshard_after_forward", "reduce_dtype", "forward_prefetch", "backward_prefetch",
    "ddp_bucket_cap_mb", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters", "stage3_param_persistence_threshold", "world_size", "pp", "pp_schedule",
    "virtual_stages", "tp", "cp", "ep", "sequence_parallel", "build", "checkpoint_every", "save_mode", "load_mode",
    "optimizer_offload", "offload_chunk_params", "offload_prefetch", "offload_first_step", "lora_r", "lora_alpha",
    "lora_dropout", "lora_targets", "quantize", "moe_routing", "compile", "compile_mode",
)


def _all_knobs() -> tuple[SetupKnob, ...]:
    found = [k for name, cls in SECTIONS.items() for k in section_knobs(cls, (name,))]
    names = [k.name for k in found]
    if len(set(names)) != len(names) or not set(SERIAL_ORDER) <= set(names):
        raise TypeError(f"two knobs share a name, or a knob of version 1 is gone: {names}")
    place = {name: i for i, name in enumerate(SERIAL_ORDER)}
    return tuple(sorted(found, key=lambda k: place.get(k.name, len(place))))  # (a stable sort)


SETUP_KNOBS: tuple[SetupKnob, ...] = _all_knobs()
KNOBS: dict[str, SetupKnob] = {k.name: k for k in SETUP_KNOBS}


class KnobValues(types.SimpleNamespace):
    """A setup's knobs by name, as the checks read them (each error names the knob the user gave), with the
    precision the name means."""

    @property
    def prec(self) -> Precision:
        return PRECISION_TABLE[self.precision]


class TrainingSetup:
    """How the model is trained: its sections (models/config/sections.py).

    precision:
      fp32           everything fp32.
      bf16-mixed     16-bit parameters and gradients, fp32 master weights and optimizer states
      fp16-mixed     (DeepSpeed / Megatron style; `fp32_grads` keeps gradients in fp32).
      bf16-autocast  torch.autocast: fp32 parameters, gradients and states, 16-bit activations and
      fp16-autocast  16-bit weight copies cached for the forward pass.
      bf16           pure bf16: parameters, gradients and states all bf16.
    """

    __slots__ = tuple(SECTIONS)
    CHECKS_ITSELF = True  # a config field of this type is checked by this class (models/fields.py)
    batch: Batch
    loop: Loop
    precision: Precision
    optimizer: Optimizer
    checkpointing: Checkpointing
    data_parallel: DataParallel
    mesh: Mesh
    checkpoint_io: CheckpointIO
    offload: Offload
    lora: Lora
    moe: Moe
    compile: Compile
    float8: Float8
    rl: Rl

    def __init__(self, _sections: tuple[Section, ...] = (), **given) -> None:
        """`_sections`: whole sections a knob given by the same name does not replace (`replace`'s)."""
        values = {k.name: k.default for k in SETUP_KNOBS}
        whole = [*_sections, *(v for name, v in given.items() if isinstance(v, SECTIONS.get(name, ())))]
        for section in whole:  # whole sections first, then knobs over them
            name = next(n for n, cls in SECTIONS.items() if isinstance(section, cls))
            values.update({k.name: k.read_from(section) for k in SETUP_KNOBS if k.path[0] == name})
        for name, value in given.items():
            if name in KNOBS:
                if not isinstance(value, Section):
                    values[name] = value
            elif name not in SECTIONS:
                raise TypeError(f"TrainingSetup() got an unexpected keyword argument {name!r}")
        for k in SETUP_KNOBS:
            check_value(k.name, k.annotation, values[k.name], ConfigError)
        check_setup(KnobValues(**values))
        for name, cls in SECTIONS.items():
            object.__setattr__(self, name, cls.from_knobs(values))

    # --- reading and changing by knob name ------------------------------------------------------------------

    def knob(self, name: str) -> object:
        """The value of the knob `name` (`setup.knob("lora_r")` is `setup.lora.r`)."""
        return KNOBS[name].read(self)

    def knob_values(self) -> dict[str, object]:
        """The setup's one serialised form: every knob by name (the scenario file's [training] keys), in
        SERIAL_ORDER. `from_knob_values` reads it back."""
        return {k.name: k.read(self) for k in SETUP_KNOBS}

    def knob_view(self) -> KnobValues:
        """The knobs by name as the checks read them."""
        return KnobValues(**self.knob_values())

    @classmethod
    def from_knob_values(cls, values: dict) -> TrainingSetup:
        """The setup `knob_values` wrote (lists read back as the tuples they were)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    def replace(self, **changes) -> TrainingSetup:
        """This setup with knobs (by name) or whole sections changed, checked again."""
        return TrainingSetup(tuple(getattr(self, name) for name in SECTIONS), **changes)

    # --- what combines sections -----------------------------------------------------------------------------

    @property
    def effective_batch(self) -> int:
        """B_eff = micro-batch x accumulation x data-parallel degree (world_size without tp, pp, cp)."""
        return self.batch.micro_batch * self.batch.grad_accum * self.mesh.dp

    # --- a frozen value -------------------------------------------------------------------------------------

    def __setattr__(self, name, value) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other) -> bool:
        if not isinstance(other, TrainingSetup):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in SECTIONS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in SECTIONS))

    def __reduce__(self):
        return (TrainingSetup.from_knob_values, (self.knob_values(),))

    def __repr__(self) -> str:
        changed = ", ".join(f"{k.name}={k.read(self)!r}" for k in SETUP_KNOBS if k.read(self) != k.default)
        return f"TrainingSetup({changed})"


__all__ = ["TrainingSetup", "SECTIONS", "SETUP_KNOBS", "KNOBS", "KnobValues", "SERIAL_ORDER"]
