"""What a precision name means, decoded once: for each `TrainingSetup.precision`, the dtype of each kind of tensor
and whether the forward runs under torch.autocast. Every module reads these fields (`setup.precision.param`), not the
name.

| name          | parameters | activations | fp32 master | optimizer states | autocast |
|---------------|------------|-------------|-------------|------------------|----------|
| fp32          | fp32       | fp32        | no          | fp32             | no       |
| bf16-mixed    | bf16       | bf16        | yes         | fp32             | no       |
| fp16-mixed    | fp16       | fp16        | yes         | fp32             | no       |
| bf16-autocast | fp32       | bf16        | no          | fp32             | bf16     |
| fp16-autocast | fp32       | fp16        | no          | fp32             | fp16     |
| bf16          | bf16       | bf16        | no          | bf16             | no       |

Gradients take the parameters' dtype, or fp32 with `fp32_grads` (mixed precision only): `Precision.grad`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .knobs import Section, knob

# name, parameters, activations, fp32 master, optimizer states, autocast (the table above)
_ROWS = (
    ("fp32", "fp32", "fp32", None, "fp32", None),
    ("bf16-mixed", "bf16", "bf16", "fp32", "fp32", None),
    ("fp16-mixed", "fp16", "fp16", "fp32", "fp32", None),
    ("bf16-autocast", "fp32", "bf16", None, "fp32", "bf16"),
    ("fp16-autocast", "fp32", "fp16", None, "fp32", "fp16"),
    ("bf16", "bf16", "bf16", None, "bf16", None),
)
PRECISIONS = tuple(row[0] for row in _ROWS)
# other names for them, suggested when given (models/names.py), never taken: torch's dtype names, and Lightning's
# Trainer(precision=...) values (lightning/fabric/connector.py `_PRECISION_INPUT`: "32-true", "16-mixed", "bf16-true")
PRECISION_ALIASES = {"bfloat16": "bf16", "bf16-true": "bf16", "float32": "fp32", "float": "fp32", "32": "fp32",
                     "32-true": "fp32", "float16": "fp16-mixed", "half": "fp16-mixed", "fp16": "fp16-mixed",
                     "16": "fp16-mixed", "16-mixed": "fp16-mixed", "mixed": "bf16-mixed", "autocast": "bf16-autocast"}


@dataclass(frozen=True, eq=False)
class Precision(Section):
    """The setup's precision section (`setup.precision.name`): its two knobs, the precision's `name` (the string users
    write) and `fp32_grads`, and the dtypes the name means, decoded from the table."""

    DERIVED = ("param", "compute", "master", "state", "autocast")

    name: str = knob("fp32", "precision", choices=PRECISIONS, name="precision")
    param: str = "fp32"  # the dtype parameters are stored in
    compute: str = "fp32"  # the dtype of activations
    master: str | None = None  # fp32 master weights beside 16-bit parameters (mixed precision), else None
    state: str = "fp32"  # the optimizer states' dtype
    autocast: str | None = None  # torch.autocast's dtype around the forward and the loss, else None
    fp32_grads: bool = knob(False, "precision", "mixed precision: fp32 gradients", cli="on")

    @property
    def mixed(self) -> bool:
        return self.master is not None

    @property
    def uniform(self) -> bool:
        """One dtype for every tensor: no master copy, no autocast (fp32, pure bf16). The real multi-process and
        model-parallel programs measure these."""
        return self.master is None and self.autocast is None

    @property
    def grad(self) -> str:
        """The gradients' dtype: the parameters', or fp32 with `fp32_grads` (mixed precision only)."""
        return "fp32" if self.fp32_grads else self.param

    @classmethod
    def from_knobs(cls, values: dict) -> Precision:
        return dataclasses.replace(PRECISION_TABLE[values["precision"]], fp32_grads=values["fp32_grads"])


PRECISION_TABLE: dict[str, Precision] = {row[0]: Precision(*row) for row in _ROWS}
UNIFORM_PRECISIONS = tuple(p.name for p in PRECISION_TABLE.values() if p.uniform)  # ("fp32", "bf16")
