"""What a precision name means, decoded once: for each `TrainingSetup.precision`, the dtype of each kind of tensor
and whether the forward runs under torch.autocast. Every module reads these fields (`setup.prec`), not the name.

| name          | parameters | activations | fp32 master | optimizer states | autocast |
|---------------|------------|-------------|-------------|------------------|----------|
| fp32          | fp32       | fp32        | no          | fp32             | no       |
| bf16-mixed    | bf16       | bf16        | yes         | fp32             | no       |
| fp16-mixed    | fp16       | fp16        | yes         | fp32             | no       |
| bf16-autocast | fp32       | bf16        | no          | fp32             | bf16     |
| fp16-autocast | fp32       | fp16        | no          | fp32             | fp16     |
| bf16          | bf16       | bf16        | no          | bf16             | no       |

Gradients take the parameters' dtype, or fp32 with `fp32_grads` (mixed precision only): `TrainingSetup.grad_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    param: str  # the dtype parameters are stored in
    compute: str  # the dtype of activations
    master: str | None  # fp32 master weights beside 16-bit parameters (mixed precision), else None
    state: str  # the optimizer states' dtype
    autocast: str | None  # torch.autocast's dtype around the forward and the loss, else None

    @property
    def mixed(self) -> bool:
        return self.master is not None

    @property
    def uniform(self) -> bool:
        """One dtype for every tensor: no master copy, no autocast (fp32, pure bf16). The real multi-process and
        model-parallel programs measure these."""
        return self.master is None and self.autocast is None


PRECISION_TABLE: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", "fp32", "fp32", None, "fp32", None),
    Precision("bf16-mixed", "bf16", "bf16", "fp32", "fp32", None),
    Precision("fp16-mixed", "fp16", "fp16", "fp32", "fp32", None),
    Precision("bf16-autocast", "fp32", "bf16", None, "fp32", "bf16"),
    Precision("fp16-autocast", "fp32", "fp16", None, "fp32", "fp16"),
    Precision("bf16", "bf16", "bf16", None, "bf16", None),
)}
PRECISIONS = tuple(PRECISION_TABLE)
UNIFORM_PRECISIONS = tuple(p.name for p in PRECISION_TABLE.values() if p.uniform)  # ("fp32", "bf16")
