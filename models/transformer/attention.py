"""Attention as the describers write it: eager (nanoGPT / Llama's manual path) and SDPA, on the CPU or as the
CUDA kernel torch picks on the GPU profile (`GPU_TARGET`; models/gpu.py `sdpa_backend`), with what each saves.
"""

from __future__ import annotations

from .. import gpu
from ..tape import TensorSpec
from .writer import TapeWriter


def attention_eager(w: TapeWriter, prefix: str, q_src: TensorSpec, k_src: TensorSpec, v_src: TensorSpec,
                     n_head: int, n_kv: int, head_dim: int, dropout: float, fp32_softmax: bool = False) -> TensorSpec:
    B, T = q_src.shape[0], q_src.shape[1]
    D = n_head * head_dim
    with w.attention_core():
        y = _attention_eager_core(w, prefix, q_src, k_src, v_src, n_head, head_dim, dropout, fp32_softmax)
    (merged,) = w.op(f"{prefix}.merge_heads", "clone", [y], [w.t(f"{prefix}.merged", (B, T, D))])
    return merged


def _attention_eager_core(w: TapeWriter, prefix: str, q_src: TensorSpec, k_src: TensorSpec, v_src: TensorSpec,
                          n_head: int, head_dim: int, dropout: float, fp32_softmax: bool = False) -> TensorSpec:
    """softmax(q k^T * scale, causal) v per head, as nanoGPT's eager path runs it. `fp32_softmax` is HF's
    Llama convention, `softmax(scores, dtype=torch.float32).to(q.dtype)`: with 16-bit scores the softmax
    output is fp32 (saved by its backward) and the matmul with v saves a 16-bit copy of it."""
    B, T = q_src.shape[0], q_src.shape[1]
    hd = head_dim
    # q, k and v split from one projection (nanoGPT's GPT-2): views, one gradient piece each (`TapeOp.views`)
    split = q_src.name == k_src.name == v_src.name and q_src.shape[-1] == 3 * n_head * hd
    q, k = w.op(f"{prefix}.qk", "matmul", [q_src, k_src],
                [w.t(f"{prefix}.q_contig", (B, n_head, T, hd)), w.t(f"{prefix}.k_contig", (B, n_head, hd, T))],
                saves=(f"{prefix}.q_contig", f"{prefix}.k_contig"), views=(q_src.name, k_src.name) if split else ())
    (scores,) = w.op(f"{prefix}.scores", "bmm", [q, k], [w.t(f"{prefix}.scores", (B, n_head, T, T))],
                     flops=2 * B * n_head * T * T * hd)
    (scaled,) = w.op(f"{prefix}.scale", "mul", [scores], [w.t(f"{prefix}.scaled", (B, n_head, T, T))])
    (mask,) = w.op(f"{prefix}.causal_mask", "eq", [], [w.t(f"{prefix}.causal_mask", (1, 1, T, T), "bool", False)])
    (masked,) = w.op(f"{prefix}.masked_fill", "masked_fill", [scaled, mask],
                     [w.t(f"{prefix}.masked", (B, n_head, T, T))], saves=(mask.name,))
    sm_dtype = "fp32" if fp32_softmax else w.softmax_dtype(masked)
    src, held, tmp = masked, (), ()
    if not w.cpu:
        # aten/src/ATen/native/cuda/SoftMax.cu softmax_backward_cuda_out: `tmp = grad * output` besides grad_input
        tmp = (w.t(f"{prefix}.softmax.grad_times_output", (B, n_head, T, T), sm_dtype, False),)
        if sm_dtype != masked.dtype and masked.dtype == "bf16":
            # aten/src/ATen/native/SoftMax.cpp softmax(input, dim, dtype): only fp16 on CUDA takes the half-to-float
            # kernel; a bf16 input is first converted (`input_.toType(dtype)`, a new tensor gone when the call
            # returns; its ToCopyBackward turns the fp32 gradient back to bf16). The input is the caller's `att`
            # until the call returns
            (src,) = w.op(f"{prefix}.softmax_upcast", "to_copy", [masked],
                          [w.t(f"{prefix}.softmax_upcast", masked.shape, sm_dtype)])
            held = (masked.name,)
    (probs,) = w.op(f"{prefix}.softmax", "softmax", [src], [w.t(f"{prefix}.softmax", (B, n_head, T, T), sm_dtype)],
                    saves=(f"{prefix}.softmax",), flops=5 * B * n_head * T * T, bwd_workspace=tmp, releases=held)
    if fp32_softmax and masked.dtype != "fp32":
        (probs,) = w.op(f"{prefix}.softmax_cast", "to_copy", [probs],
                        [w.t(f"{prefix}.softmax_cast", probs.shape, masked.dtype)])
    probs = w.dropout(f"{prefix}.attn_dropout", probs, dropout)
    # CUDA autocast: softmax ran in fp32 (autocast_mode.cpp's fp32 list), the @ v matmul casts it to 16-bit (a new
    # tensor, saved by the matmul; the fp32 one stays saved by the softmax)
    probs = w.autocast_input(f"{prefix}.pv", probs)
    (v,) = w.op(f"{prefix}.v_contig", "clone", [v_src], [w.t(f"{prefix}.v_contig", (B, n_head, T, hd))],
                views=(v_src.name,) if split else ())
    (y,) = w.op(f"{prefix}.pv", "bmm", [probs, v], [w.t(f"{prefix}.pv", (B, n_head, T, hd))],
                saves=(probs.name, v.name), flops=2 * B * n_head * T * T * hd)
    return y


# What a GPU profile's tape is written for: one compute capability stands for the GPU profiles (A100 sm80,
# H100/H200 sm90 choose the same SDPA kernels under torch 2.6's rules); the torch version is the writer's
# (`TapeWriter.torch_version`, the run's rules where the describer passes them), else the real H100 snapshots'.
GPU_TARGET = ((9, 0), "2.6")


def cuda_sdpa_backend(q: TensorSpec, n_head: int, n_kv: int, head_dim: int, dropout: float,
                      torch_version: str = GPU_TARGET[1]) -> str:
    """The CUDA SDPA kernel of `F.scaled_dot_product_attention(q, k, v, is_causal=True)` the hand-written tape writes
    (`sdpa_choice` of q's dtype and length)."""
    return sdpa_choice(q.dtype, q.shape[1], n_head, n_kv, head_dim, dropout, torch_version)


def sdpa_choice(dtype: str, seq: int, n_head: int, n_kv: int, head_dim: int, dropout: float,
                torch_version: str = GPU_TARGET[1], compute_capability: tuple[int, int] | None = None) -> str:
    """The causal SDPA kernel torch `torch_version` picks for these inputs. Without `compute_capability`, the one the
    hand-written tape writes, on `GPU_TARGET`'s sm: from 2.13 (its cu130 wheel's cuDNN 9.20) cuDNN attention for
    16-bit inputs (models/gpu.py `sdpa_cudnn`); else the choice under GPU_TARGET's (2.6's) rules, as before. With
    it, torch's own pick on that sm under the release's rules (peakledger/where.py's note on another card)."""
    cudnn, cuda_major = gpu.sdpa_cudnn(torch_version)
    if compute_capability is None:
        cc, rules = GPU_TARGET[0], (gpu.kernel_rules(torch_version) if cudnn else GPU_TARGET[1])
    else:
        cc, rules = compute_capability, gpu.kernel_rules(torch_version)
    return gpu.sdpa_backend(dtype, head_dim, dropout, False, True, cc, rules, seq_q=seq, seq_k=seq, n_head=n_head,
                            n_kv_head=n_kv, enable_gqa=n_kv != n_head, cudnn_version=cudnn, cuda_major=cuda_major)


def attention_sdpa(w: TapeWriter, prefix: str, q: TensorSpec, k: TensorSpec, v: TensorSpec,
                    n_head: int, head_dim: int, n_kv: int | None = None, dropout: float = 0.0) -> TensorSpec:
    B, T = q.shape[0], q.shape[1]
    D = n_head * head_dim
    if not w.cpu:
        return _attention_sdpa_cuda(w, prefix, q, k, v, n_head, n_kv or n_head, head_dim, dropout)
    with w.attention_core():
        out, lse = w.op(f"{prefix}.sdpa", "sdpa", [q, k, v],
                        [w.t(f"{prefix}.sdpa.out", (B, T, D)),
                         w.t(f"{prefix}.sdpa.lse", (B, n_head, T), "fp32", False)],
                        saves=(q.name, k.name, v.name, f"{prefix}.sdpa.out", f"{prefix}.sdpa.lse"),
                        flops=4 * B * n_head * T * T * head_dim)
    return out


def _attention_sdpa_cuda(w: TapeWriter, prefix: str, q: TensorSpec, k: TensorSpec, v: TensorSpec, n_head: int,
                         n_kv: int, head_dim: int, dropout: float) -> TensorSpec:
    """`F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal=True, enable_gqa=...)` on CUDA: the kernel
    models/gpu.py picks, its outputs (named as the CPU op's: .sdpa.out, .sdpa.lse), the tensors its backward
    keeps and its temporaries. The math fallback is written as eager attention (see the module docstring)."""
    backend = cuda_sdpa_backend(q, n_head, n_kv, head_dim, dropout, w.torch_version)
    if backend == "math":
        return attention_eager(w, prefix, q, k, v, n_head, n_kv, head_dim, dropout, fp32_softmax=True)
    B, T = q.shape[0], q.shape[1]
    # flash / efficient are written with GPU_TARGET's (2.6's) kernel rules whatever the version, as before; cuDNN,
    # chosen from 2.13, with the version's
    rules = gpu.kernel_rules(w.torch_version) if backend == "cudnn" else GPU_TARGET[1]
    kernel = gpu.sdpa_kernel(backend, B, n_head, T, T, head_dim, q.dtype, dropout, rules, n_kv_head=n_kv)
    roles = {"out": f"{prefix}.sdpa.out", "logsumexp": f"{prefix}.sdpa.lse"}
    name = {"q": q.name, "k": k.name, "v": v.name}
    outputs = []
    for piece in kernel.outputs:
        name[piece.role] = roles.get(piece.role, f"{prefix}.sdpa.{piece.role}")
        shape = (B, T, piece.shape[1] * piece.shape[2] * piece.shape[3] // T) if piece.role == "out" else piece.shape
        outputs.append(w.t(name[piece.role], shape, piece.dtype, piece.role == "out"))
    temps = lambda pieces: tuple(w.t(f"{prefix}.sdpa.{p.role}", p.shape, p.dtype, False) for p in pieces)  # noqa: E731
    with w.attention_core():
        out = w.op(f"{prefix}.sdpa", "sdpa", [q, k, v], outputs, saves=tuple(name[r] for r in kernel.saved),
                   workspace=temps(kernel.workspace), bwd_workspace=temps(kernel.bwd_workspace),
                   flops=4 * B * n_head * T * T * head_dim)[[p.role for p in kernel.outputs].index("out")]
    if out.shape[-1] != n_head * head_dim:  # head_dim padded to 8: the sliced output is copied contiguous
        (out,) = w.op(f"{prefix}.sdpa.unpad", "clone", [out],
                      [w.t(f"{prefix}.sdpa.unpadded", (B, T, n_head * head_dim))])
    return out
