"""QLoRA: the base model's block linears in 4 bits (bitsandbytes 0.50 `Linear4bit`, nf4, double quantization),
LoRA adapters on top (models/lora.py). traces/reference/qlora.py builds the same model for real.

Storage (bitsandbytes/functional.py `quantize_4bit`, blocksize 64, `compress_statistics=True`), per linear of
n = out x in weights, all frozen parameters of the base:
    weight          uint8 ((n + 1) // 2, 1): two 4-bit codes per byte (`Params4bit`)
    weight_absmax   uint8 (ceil(n / 64),): each 64-weight block's absmax, itself 8-bit quantized
                    (`quantize_blockwise(absmax - offset, blocksize=256)`)
    weight_offset   fp32 (): the mean absmax subtracted before that
    weight_code     fp32 (16,): the nf4 code map (`get_4bit_type("nf4")`)
    weight_absmax2  fp32 (ceil(ceil(n / 64) / 256),): the absmaxes of the absmaxes
    weight_code2    fp32 (256,): the 8-bit dynamic map of the second quantization
(the last five are the `quant_state` tensors; the reference registers them on the module to label them).

Forward (`Linear4bit.forward` -> `bnb.matmul_4bit` -> `MatMul4Bit` when the input needs a gradient, else the
kernel directly; bitsandbytes/autograd/_functions.py): `gemm_4bit` dequantizes and multiplies. On the CPU (the
"default" kernel, backends/default/ops.py `_gemm_4bit_default_impl`) and on CUDA past 4 tokens
(backends/cuda/ops.py `_dequant_linear_fallback`; between 5 and 1536 tokens the per-architecture heuristic may
pick the fused kernel instead: peakledger assumes the fallback there, the larger) it holds, until it returns:
the absmaxes dequantized to fp32 (a first tensor, then `+ offset` in a second), and the whole weight
dequantized to the input's dtype (out x in). A fused CUDA kernel (<= 4 tokens) holds neither. Nothing is saved
for backward but the packed weight (a parameter; `ctx.tensors`, not `save_for_backward`).

Backward (`MatMul4Bit.backward`, input gradient only): `F.dequantize_4bit(B, state)` again: absmax fp32 (offset
added in place, freed when it returns) and the weight in the quantization dtype (the parameters' dtype when it
was quantized), then `grad_output @ W`: the weight lives while the input's gradient is made.
"""

from __future__ import annotations

from .tape import ParamSpec, TensorSpec

BLOCKSIZE = 64  # bitsandbytes quantize_4bit's default blocksize
BLOCKSIZE2 = 256  # the nested (double) quantization's blocksize
FUSED_MAX_TOKENS = 4  # backends/cuda/ops.py _GEMM_4BIT_CUSTOM_FLOOR_M: the fused kernel, no dequantized weight


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def packed_params(weight: str, shape: tuple[int, int]) -> list[tuple[ParamSpec, str]]:
    """The packed weight and its quantization state, as (ParamSpec, dtype), in registration order."""
    n = shape[0] * shape[1]
    blocks = _ceil(n, BLOCKSIZE)
    return [(ParamSpec(weight, ((n + 1) // 2, 1)), "int8"), (ParamSpec(f"{weight}_absmax", (blocks,)), "int8"),
            (ParamSpec(f"{weight}_offset", ()), "fp32"), (ParamSpec(f"{weight}_code", (16,)), "fp32"),
            (ParamSpec(f"{weight}_absmax2", (_ceil(blocks, BLOCKSIZE2),)), "fp32"),
            (ParamSpec(f"{weight}_code2", (256,)), "fp32")]


def nf4_linear(w, name: str, x: TensorSpec, out_features: int, weight: str, bias: str | None) -> TensorSpec:
    """`Linear4bit.forward` in the compute dtype (the setup's): dequantize, multiply, nothing saved."""
    B, T, in_features = x.shape
    n = out_features * in_features
    blocks = _ceil(n, BLOCKSIZE)
    if x.dtype != w.act:  # `x = x.to(self.compute_dtype)`
        (x,) = w.op(f"{name}.compute_cast", "to_copy", [x], [w.t(f"{name}.in_compute", x.shape, w.act)])
    quant = (weight, f"{weight}_absmax", f"{weight}_offset", f"{weight}_code", f"{weight}_absmax2",
             f"{weight}_code2")
    params = quant + ((bias,) if bias else ())
    weight_dtype = w.setup.precision.param  # Params4bit's quant_state.dtype: the weight's dtype when quantized
    # the absmaxes (n / 16 bytes) go when dequantize_4bit returns, before the matmul makes the input's gradient
    # (B x T x in, larger): the backward's highest moment holds the dequantized weight and that gradient
    bwd = (w.t(f"{name}.weight_dequant_grad", (out_features, in_features), weight_dtype, False),)
    flops = 2 * B * T * in_features * out_features
    if not w.cpu and B * T <= FUSED_MAX_TOKENS:  # the fused CUDA kernel
        (y,) = w.op(name, "nf4_linear", [x], [w.t(f"{name}.out", (B, T, out_features))], params=params,
                    bwd_workspace=bwd, flops=flops)
        return y
    (absmax,) = w.op(f"{name}.absmax_dequant", "dequantize_blockwise", [],
                     [w.t(f"{name}.absmax", (blocks,), "fp32", False)],
                     workspace=(w.t(f"{name}.absmax_scaled", (blocks,), "fp32", False),), params=quant[1:])
    (wdq,) = w.op(f"{name}.weight_dequant", "dequantize_4bit", [absmax],
                  [w.t(f"{name}.weight_dequant", (out_features, in_features), w.act, False)], params=quant[:1])
    (y,) = w.op(name, "nf4_linear", [x, wdq, absmax], [w.t(f"{name}.out", (B, T, out_features))], params=params,
                bwd_workspace=bwd, flops=flops)
    return y


__all__ = ["packed_params", "nf4_linear", "BLOCKSIZE", "BLOCKSIZE2"]
