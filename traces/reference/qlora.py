"""QLoRA's base model for real: every block linear of a reference model replaced by a bitsandbytes `Linear4bit`
(nf4, double quantization), as transformers' `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=<the compute dtype>)` loads it (transformers/integrations/
bitsandbytes.py `replace_with_bnb_linear`: lm_head is kept). The quantization state's tensors are registered on
each module as frozen parameters (`weight_absmax`, ...), sharing their storage: no memory is added, but the
tracker labels them as the frozen base, as the describer does.

The 4-bit matmul runs bitsandbytes' own CPU kernel of `gemm_4bit` (backends/default/ops.py
`_gemm_4bit_default_impl`) called as Python inside a copy of `MatMul4Bit` (`_VisibleMatMul4Bit`), not through the
`torch.ops.bitsandbytes.gemm_4bit` custom op: the same ops and allocations, but a TorchDispatchMode (the
allocation tracker) sees the op's own temporaries (the dequantized absmaxes and weight) instead of only its output.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...models.config import TrainingSetup, TransformerConfig
from ...models.lora import BLOCK_LINEARS
from .nanogpt import TORCH_DTYPES


def quantize_linears(model: nn.Module, cfg: TransformerConfig, setup: TrainingSetup) -> None:
    import bitsandbytes as bnb

    compute = TORCH_DTYPES[setup.precision.compute]
    shared: dict[int, nn.Parameter] = {}
    for path, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{path}.{child_name}" if path else child_name
            linears = BLOCK_LINEARS[cfg.architecture]
            if not (isinstance(child, nn.Linear) and any(full.endswith("." + p) for p in linears)):
                continue
            q = _visible_linear4bit_class()(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", quant_storage=torch.uint8).to("cpu")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=child.bias.requires_grad)
            _register_quant_state(q, shared)
            setattr(parent, child_name, q)


@functools.cache
def _visible_linear4bit_class():
    import bitsandbytes as bnb
    from bitsandbytes.autograd._functions import MatMul4Bit
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    def gemm(A, B, qs, bias):
        """bitsandbytes/autograd/_functions.py MatMul4Bit.forward's kernel call (nested quant state)."""
        return _gemm_4bit_default_impl(A, B.view(-1, 1), qs.shape, qs.state2.absmax, qs.blocksize, qs.quant_type,
                                       bias=bias, absmax_8bit=qs.absmax, absmax_code=qs.state2.code,
                                       absmax_offset=qs.offset)

    class VisibleMatMul4Bit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, A, B, out=None, bias=None, quant_state=None):
            ctx.is_empty = False
            output = gemm(A, B, quant_state, bias)
            ctx.state = quant_state
            ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
            ctx.tensors = (None, B.view(-1, 1)) if any(ctx.needs_input_grad[:2]) else (None, None)
            return output

        backward = MatMul4Bit.backward

    class VisibleLinear4bit(bnb.nn.Linear4bit):
        """`Linear4bit.forward` (bitsandbytes/nn/modules.py) in training, its matmul through VisibleMatMul4Bit
        (bitsandbytes' `matmul_4bit` calls the kernel directly when no gradient is needed: the same kernel)."""

        def forward(self, x):
            quant_state = self.weight.quant_state
            if not self.compute_type_is_set:
                self.set_compute_type(x)
                self.compute_type_is_set = True
            inp_dtype = x.dtype
            if self.compute_dtype is not None:
                x = x.to(self.compute_dtype)
            bias = self.bias
            if bias is not None:
                if bias.dtype != x.dtype:
                    bias.data = bias.data.to(x.dtype)
                bias = bias.to(self.compute_dtype)
            if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
                out = VisibleMatMul4Bit.apply(x, self.weight, None, bias, quant_state)
            else:
                out = gemm(x, self.weight, quant_state, bias)
            return out.to(inp_dtype)

    return VisibleLinear4bit


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
