"""QLoRA's base model for real: every block linear of a reference model replaced by a bitsandbytes `Linear4bit`
(nf4, double quantization), as transformers' `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=<the compute dtype>)` loads it (transformers/integrations/
bitsandbytes.py `replace_with_bnb_linear`: lm_head is kept). The quantization state's tensors are registered on
each module as frozen parameters (`weight_absmax`, ...; the nf4 code map shared by all layers once), sharing
their storage: no memory is added, but the tracker labels them as the frozen base, as the describer does."""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import TrainingSetup, TransformerConfig
from .lora import BLOCK_LINEARS
from .reference import TORCH_DTYPES


def quantize_linears(model: nn.Module, cfg: TransformerConfig, setup: TrainingSetup) -> None:
    import bitsandbytes as bnb

    compute = TORCH_DTYPES[setup.compute_dtype]
    shared: dict[int, nn.Parameter] = {}
    for path, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{path}.{child_name}" if path else child_name
            if not (isinstance(child, nn.Linear) and any(full.endswith("." + p) for p in BLOCK_LINEARS[cfg.family])):
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", quant_storage=torch.uint8).to("cpu")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=child.bias.requires_grad)
            _register_quant_state(q, shared)
            setattr(parent, child_name, q)


def _register_quant_state(module: nn.Module, shared: dict[int, nn.Parameter]) -> None:
    qs = module.weight.quant_state
    tensors = {"weight_absmax": qs.absmax, "weight_offset": qs.offset, "weight_code": qs.code,
               "weight_absmax2": qs.state2.absmax, "weight_code2": qs.state2.code}
    for name, t in tensors.items():
        key = t.untyped_storage().data_ptr()
        if key in shared:  # one storage (bitsandbytes caches the dynamic map): registered once
            continue
        shared[key] = nn.Parameter(t, requires_grad=False)
        module.register_parameter(name, shared[key])


__all__ = ["quantize_linears"]
