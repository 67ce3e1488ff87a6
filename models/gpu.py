"""What a CUDA device allocates that the program's tensors do not show: rules of torch 2.6's CUDA paths.

The describers emit tensors; on a GPU device profile the replay adds what torch's CUDA libraries hold in
the caching allocator (so it counts in allocated and reserved memory), and the device profile names what
lies outside the allocator (counted in the device total only):

- cuBLAS workspace: one block per (cuBLAS handle, stream), allocated through the caching allocator at the
  handle's first GEMM and never freed (aten/src/ATen/cuda/CublasHandlePool.cpp, cublas_handle_stream_to_
  workspace). Handles are per thread: the forward runs on the Python thread, backward on autograd's
  device thread, so a training step holds two. Size (getChosenWorkspaceSize): 32 MiB (":4096:8") on sm90,
  else ":4096:2:16:8" = 8 MiB + 128 KiB. Seen in the shared H100 snapshots: 33,554,432 B blocks.
- cuBLASLt workspace (torch 2.11): one more block per (cuBLAS handle, stream), allocated through the caching
  allocator right after the cuBLAS workspace at the handle's first GEMM that takes the cuBLASLt path, and never
  freed (CublasHandlePool.cpp getCUDABlasLtWorkspace, cublaslt_handle_stream_to_workspace; on CUDA the Lt handle
  is the cuBLAS handle, so it is per thread too). Size getCUDABlasLtWorkspaceSize: CUBLASLT_WORKSPACE_SIZE,
  default 1024 KiB (below the cuBLAS workspace, so the size's "unified" cap leaves it). Not shared with the cuBLAS
  workspace unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1. Which GEMMs take the Lt path: `addmm_takes_cublaslt`.
  Seen in the H200 snapshots (torch 2.11): 1,048,576 B after the 33,554,432 B workspace at the first biased
  linear, a second one when a checkpointed region's recompute runs one on autograd's thread. Other versions
  (`cublaslt_workspace_bytes`): torch 2.6 gave each Lt call a workspace of its own, freed when the call returned
  (persistent per handle and stream only since pytorch#156495, June 2025), whose default size on sm90 in 2.6 is not
  established here (pytorch#120925 raised it to 32 MiB on sm9x in 2024; 2.11's source is back at 1 MiB): not
  modelled. After 2.11 (pytorch#175879) the Lt path uses the cuBLAS workspace by default: no block of its own.
- CUDA context and the loaded kernels: outside the allocator; an assumption per device profile.
- NCCL communicator buffers (world size > 1): outside the allocator; NCCL_BUFFSIZE (4 MiB, NCCL's default)
  per channel for the ring's send and receive peers, times an assumed channel count.

Kernel paths: the describers write the CPU program's tensors (the traced one records the CPU kernels); on a
CUDA device profile some ops run other kernels that allocate and save other tensors. The rules below are read
from torch's sources: torch 2.6 (the version of the real GPU snapshots; aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp as of 2.5.1-2.6, with cuDNN after math in its priority order, flash on sm80-sm90) and the
source stored for the latest torch ("2.13", the version pinned here: flash rng state on the device, cuDNN
first on sm90/sm100 with cuDNN > 9.15, flash/efficient up to sm121).
- `sdpa_backend`: which SDPA kernel `F.scaled_dot_product_attention` runs on CUDA (select_sdp_backend).
- `sdpa_kernel`: what that kernel allocates, saves for backward and uses as temporaries (the math backend is
  torch's composite of ordinary ops: the caller writes those).
- `reduce_staging_bytes`: the global-reduction staging buffer and semaphores of a CUDA reduction
  (Reduce.cuh). It reproduces the shared H100 snapshots' loss-phase temporaries exactly (`torch.max` over a
  [512, 10000] fp32 tensor whose vocab dim is not the fastest: 164,626,432 B + 16 B; its `sum`: 41,156,608 B),
  but it needs the input's strides, which no tape carries: it is a rule, applied nowhere yet.

Not modelled (cannot be established from the sources with certainty, or needs what tapes do not carry):
- flash's split-KV forward accumulators (flash_api.cpp set_params_splitkv: only when batch*heads*ceil(T/64) is
  below 0.8 x the SM count (x2 after 2.7) and T_k exceeds one key block; depends on the device's SM count);
- memory-efficient attention's fp32 output accumulator (16-bit, head_dim > 128: depends on the CUTLASS kernel
  picked), its backward workspace and its one-chunk dq/dk/dv (when q, k, v share a storage);
- cuDNN attention's workspace and rng tensors (only chosen under "2.13" with an explicit cuDNN version);
- attention-mask conversion and padding (convert_boolean_attn_mask, preprocess_mask's 16-column padding);
- the gradient of a padded head_dim (flash pads q, k, v to a multiple of 8: the forward copies are modelled);
- reductions' staging buffers in the tapes (strides unknown, see above), e.g. RMSNorm weight-gradient sums
  seen in the CS336 backward (10,485,760 B at ctx 128), whose layout was not reproduced;
- F.cross_entropy (CUDA log_softmax / nll_loss) and the fused LayerNorm/RMSNorm kernels' backward buffers:
  not established from the sources here (the norm kernels also changed between 2.6 and 2.13), so nothing is
  changed for them. The CS336 H100 snapshots (fp32, a hand-written loss and RMSNorm) show no other forward
  difference than the cuBLAS workspace and the reduction staging buffers above (bench/notes_cs336.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..simulator.safe_io import InputError
from ..simulator.torch_rules import nearest

MiB = 1 << 20
NCCL_BUFFSIZE = 4 * MiB  # NCCL's default (docs: NCCL_BUFFSIZE)
NCCL_CHANNELS = 16  # assumption: NCCL's channel count on NVLink-connected H100/A100 nodes varies (8-32)


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """getChosenWorkspaceSize (CublasHandlePool.cpp, torch 2.6): ":4096:8" on sm90, else ":4096:2:16:8"."""
    if compute_capability == (9, 0):
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


CUBLASLT_WORKSPACE_KIB = 1024  # CublasHandlePool.cpp parseCUDABlasLtWorkspaceSize: CUBLASLT_WORKSPACE_SIZE's default
CUBLASLT_DTYPES = ("fp64", "fp32", "fp16", "bf16")  # Blas.cpp isInputCompliesAddmmCudaLt: the dtypes Lt takes
LINEAR_KINDS = ("linear", "frozen_linear")  # the hand-written describers' F.linear (models/transformer/, lora.py)


def cublaslt_workspace_bytes(torch_version: str) -> int:
    """The persistent cuBLASLt workspace of one (cuBLAS handle, stream) under `torch_version` (module docstring):
    the release's rule set (simulator/torch_rules): 1 MiB in torch 2.11 (CublasHandlePool.cpp
    getCUDABlasLtWorkspace, a block of its own); 0 where none is modelled (2.6: a workspace per call, size not
    established; 2.13: the cuBLAS workspace is used). A release not modelled follows the nearest older one."""
    return nearest(torch_version).cublaslt_workspace_bytes


def addmm_takes_cublaslt(m: int, k: int, n: int, bias_shape: tuple[int, ...] | None, dtype: str) -> bool:
    """Whether CUDA's addmm of a (m, k) by (k, n) product plus `bias` runs through cuBLASLt (gemm_and_bias):
    aten/src/ATen/native/cuda/Blas.cpp addmm_out_cuda_impl / isInputCompliesAddmmCudaLt, with beta 1 (F.linear and
    Conv1D's addmm), a new contiguous 2-D result, and DISABLE_ADDMM_CUDA_LT unset: a contiguous bias that is 1-D
    (or squeezes to 1-D) of n elements, a dtype Lt takes, and every matrix dim above 1 (CUDA >= 12.1 builds: no
    size limits). Everything else, mm (beta 0) included, runs cuBLAS's gemm (the default blas backend)."""
    if bias_shape is None or not bias_shape or bias_shape[-1] != n or prod(bias_shape) != n:
        return False
    return dtype in CUBLASLT_DTYPES and m > 1 and k > 1 and n > 1


def gemm_takes_cublaslt(kind: str, operands: list[tuple[int, ...]], out_shape: tuple[int, ...], dtype: str,
                        flops: int = 0) -> bool:
    """`addmm_takes_cublaslt` for a tape op: `operands` are the shapes of what it reads, in order (inputs, then
    parameters). F.linear (`LINEAR_KINDS`: input, 2-D weight, 1-D bias) is addmm on the input flattened to 2-D
    when it is 2-D or 3-D (aten/src/ATen/native/Linear.cpp linear, _flatten_nd_linear; the describers' inputs are
    contiguous). An aten addmm (kind "addmm": bias, mat1, mat2 in some order, the bias 1-D; mat1 may be a view of
    a larger storage, as F.linear's flattened input) reads m and n off its output (rows: all but the last dim) and
    k off its `flops` (torch/utils/flop_counter.py addmm_flop: 2 m k n), else off an operand of m rows."""
    if kind in LINEAR_KINDS:
        if not operands or len(operands[0]) not in (2, 3):
            return False
        x = operands[0]
        bias = next((s for s in operands[1:] if len(s) == 1), None)
        return addmm_takes_cublaslt(prod(x[:-1]), x[-1], out_shape[-1], bias, dtype)
    if kind != "addmm" or len(out_shape) < 2:
        return False
    m, n = prod(out_shape[:-1]), out_shape[-1]  # (the hand-written HF Conv1D's addmm writes its output 3-D)
    bias = next((s for s in operands if len(s) == 1), None)
    if flops and m and n:
        k = flops // (2 * m * n)
    else:
        mat1 = next((s for s in operands if len(s) == 2 and s[0] == m), None)
        if mat1 is None:
            return False
        k = mat1[1]
    return addmm_takes_cublaslt(m, k, n, bias, dtype)


def cuda_fused_rms_norm(torch_version: str) -> bool:
    """Whether nn.RMSNorm / F.rms_norm on a CUDA tensor runs torch's fused kernel: aten::rms_norm calls
    _fused_rms_norm (native_functions.yaml `CUDA: _fused_rms_norm_cuda`, added by pytorch#153666 in 2025), which
    allocates the output and the fp32 rstd per row only and saves input, rstd and weight (derivatives.yaml); its
    backward (_fused_rms_norm_backward) allocates the input's and the weight's gradients. Seen in the H200 snapshots
    (torch 2.11). torch 2.6 has no such kernel: rms_norm is the composite of pow, mean, rsqrt and products. The
    release's rule set says (simulator/torch_rules `fused_rms_norm`)."""
    return nearest(torch_version).fused_rms_norm


def nccl_buffer_bytes(world_size: int) -> int:
    """Assumed NCCL buffers of one rank's data-parallel communicator: send + receive per channel."""
    return 0 if world_size <= 1 else 2 * NCCL_CHANNELS * NCCL_BUFFSIZE


# -- SDPA on CUDA: which kernel ------------------------------------------------------------------------------

SDPA_RULES = ("2.6", "2.13")
HALF = ("fp16", "bf16")


def sdpa_rules(torch_version: str) -> str:
    """The rule set of a torch version: "2.6" (2.6.x) or "2.13" (the latest source, pinned here)."""
    parts = str(torch_version).strip().split(".")
    key = ".".join(parts[:2])
    if key not in SDPA_RULES:
        raise ValueError(f"torch_version {torch_version!r}: SDPA kernel rules are modelled for {', '.join(SDPA_RULES)}")
    return key


def kernel_rules(torch_version: str) -> str:
    """The SDPA rule set that holds for a torch version: its release's `sdpa` (simulator/torch_rules), a release
    not modelled following the nearest older one: "2.6" for 2.6.x and older, else "2.13" (the device rng state of
    flash came with 2.7)."""
    try:
        return nearest(torch_version).sdpa
    except InputError:
        raise ValueError(f"torch_version {torch_version!r} is not a version (e.g. 2.6, 2.11)") from None


def _sm(cc, lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    # sdp_utils.cpp check_sm_version<lower, upper>: inclusive on (major, minor)
    return lo <= tuple(cc) <= hi


def _heads_ok(n_head: int, n_kv: int, enable_gqa: bool, supports_gqa: bool) -> bool:
    # sdp_utils_cpp.h check_batch_size_and_num_heads_dense: GQA only where the backend supports it and
    # enable_gqa is set (then q heads divisible by kv heads); otherwise all heads equal
    if enable_gqa and supports_gqa:
        return n_head % n_kv == 0
    return n_head == n_kv


def _gemm_alignment(dtype: str, cc) -> int:
    # sdp_utils.cpp minimum_gemm_alignment: tensor cores on sm80+ (sm7x: 16-bit only); 4 on sm80+, at least
    # 128 bits per row with tensor cores
    half = dtype in HALF
    use_tc = cc[0] >= 8 or (cc[0] >= 7 and half)
    align = 4 if cc[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if use_tc else align


def _can_flash(v, dtype, hd, hd_v, dropout, has_mask, is_causal, cc, seq_q, seq_k, n_head, n_kv, gqa, grad) -> bool:
    # sdp_utils.cpp can_use_flash_attention (check_* filters in its order)
    if has_mask:  # check_for_attn_mask (sdp_utils_cpp.h): flash takes no attn_mask
        return False
    if not (hd == hd_v and hd <= 256):  # check_head_dim_size_flash: equal, <= 256 (padded to 8 by the caller)
        return False
    if not _sm(cc, (8, 0), (9, 0) if v == "2.6" else (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89 (2.13: also sm120-121)
    odd_sm = _sm(cc, (8, 6), (8, 9)) or (v == "2.13" and _sm(cc, (12, 0), (12, 1)))
    if grad and odd_sm and not (hd <= 192 or (dropout == 0 and hd > 224)):
        return False
    # check_flash_causal_non_square_seqlens
    if is_causal and seq_q is not None and seq_k is not None and seq_q != seq_k:
        return False
    if dtype not in (HALF if cc[0] >= 8 else ("fp16",)):  # check_dtypes_low_precision
        return False
    return _heads_ok(n_head, n_kv, gqa, True)  # flash supports GQA (CUDA)


def _can_efficient(v, dtype, hd, hd_v, cc, n_head, n_kv, gqa) -> bool:
    # sdp_utils.cpp can_use_mem_efficient_attention
    if not _sm(cc, (5, 0), (9, 0) if v == "2.6" else (12, 1)):  # check_mem_efficient_hardware_support
        return False
    align = _gemm_alignment(dtype, cc)  # check_head_dim_size_mem_efficient
    if not (hd % align == 0 and hd_v % align == 0 and hd > 0 and hd_v > 0):
        return False
    # dense constraints: check_batch_size_and_num_heads_dense<false> (no GQA). Under "2.13" too: torch 2.13's own
    # fake kernel of the backward (torch/_meta_registrations.py meta__scaled_dot_product_efficient_backward)
    # returns grad_k / grad_v at the query's heads, which autograd refuses for fewer key heads
    if not _heads_ok(n_head, n_kv, gqa, False):
        return False
    return dtype in (("fp16", "fp32", "bf16") if cc[0] >= 8 else ("fp16", "fp32"))  # check_tensor_dtype


def _prefer_cudnn(cc, cudnn_version: int | None, cuda_major: int = 12) -> bool:
    # sdp_utils.cpp check_prefer_cudnn_attention (2.13): cuDNN > 9.15.0 on sm9x / sm10x; CUDA < 13 wheels only
    # sm90 / sm100 / sm103 ("(!minor || minor == 3)")
    if cudnn_version is None or cudnn_version <= 91500 or cc[0] not in (9, 10):
        return False
    return cuda_major >= 13 or cc[1] in (0, 3)


def sdpa_cudnn(torch_version: str) -> tuple[int | None, int]:
    """(cuDNN version, CUDA major) of `torch_version`'s default CUDA wheel, what `sdpa_backend` reads for cuDNN
    attention: the release's rule set (simulator/torch_rules `sdpa_cudnn_version`, `wheel_cuda_major`)."""
    rules = nearest(torch_version)
    return rules.sdpa_cudnn_version, rules.wheel_cuda_major


def _can_cudnn(dtype, hd, hd_v, dropout, cc, seq_q, seq_k, n_head, n_kv, gqa, cudnn_version) -> bool:
    # sdp_utils.cpp can_use_cudnn_attention ("2.13"); the head-dim limit above 128 (cuDNN > 9.22 with a
    # cudnn-frontend >= 1.24 build) is not assumed
    if dropout > 0 and 91100 < cudnn_version < 91400:
        return False
    if dtype not in HALF or not _sm(cc, (8, 0), (12, 1)):  # check_dtypes_low_precision, hardware support
        return False
    if dropout * 16 != int(dropout * 16):  # check_cudnn_dropout: multiples of 1/16
        return False
    limit = 192 if (cc[0] in (9, 10) and cudnn_version >= 91100 and hd == 192 and hd_v == 128) else 128
    if hd > limit or hd_v > limit or hd % 8 or hd_v % 8:  # check_cudnn_tensor_shapes
        return False
    if seq_k == 1 or (dropout > 0 and seq_q == 1):
        return False
    return _heads_ok(n_head, n_kv, gqa, True)  # masks of check_attn_mask_shape's shapes are taken


def sdpa_backend(dtype: str, head_dim: int, dropout: float, has_mask: bool, is_causal: bool,
                 compute_capability: tuple[int, int], torch_version: str = "2.6", *, head_dim_v: int | None = None,
                 seq_q: int | None = None, seq_k: int | None = None, n_head: int = 1, n_kv_head: int | None = None,
                 enable_gqa: bool = False, requires_grad: bool = True, cudnn_version: int | None = None,
                 last_dims_contiguous: bool = True, cuda_major: int = 12) -> str:
    """"flash", "efficient", "cudnn" or "math": select_sdp_backend (sdp_utils.cpp) with every backend enabled,
    dense inputs and aligned storage offsets. 2.6: flash, efficient, math (cuDNN comes after math, so never);
    2.13: the same unless `_prefer_cudnn` (cuDNN first: `sdpa_cudnn` gives a release's cuDNN and CUDA major; torch
    2.13.0+cu130 with its cuDNN 9.20 on sm90: cuDNN for bf16 / fp16). `last_dims_contiguous` False: q, k, v or
    the mask has a last dimension of stride other than 1, which every fused kernel refuses on CUDA (sdp_utils_cpp.h
    check_last_dim_stride_equals_1_dense: the mask's stride is checked on CUDA, not on the CPU): math."""
    if not last_dims_contiguous:
        return "math"
    v = sdpa_rules(torch_version)
    cc = tuple(compute_capability)
    hd_v = head_dim if head_dim_v is None else head_dim_v
    n_kv = n_head if n_kv_head is None else n_kv_head
    order = ("flash", "efficient", "math")  # priority_order (2.6 constant; 2.13 Context's default order)
    if v == "2.13" and _prefer_cudnn(cc, cudnn_version, cuda_major):
        order = ("cudnn",) + order
    for backend in order:
        if backend == "cudnn" and _can_cudnn(dtype, head_dim, hd_v, dropout, cc, seq_q, seq_k, n_head, n_kv,
                                             enable_gqa, cudnn_version):
            return "cudnn"
        if backend == "flash" and _can_flash(v, dtype, head_dim, hd_v, dropout, has_mask, is_causal, cc, seq_q,
                                             seq_k, n_head, n_kv, enable_gqa, requires_grad):
            return "flash"
        if backend == "efficient" and _can_efficient(v, dtype, head_dim, hd_v, cc, n_head, n_kv, enable_gqa):
            return "efficient"
    return "math"  # the math fallback is always enabled


# -- SDPA on CUDA: what the kernel allocates and saves ---------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One tensor of a CUDA SDPA kernel, by role ("out", "logsumexp", "rng_state", "q_padded", ...)."""

    role: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * {"fp32": 4, "bf16": 2, "fp16": 2, "int64": 8}[self.dtype]


@dataclass(frozen=True)
class SdpaKernel:
    """`outputs`: what the forward allocates, in order (the attention output is role "out"); `saved`: the roles
    its backward node keeps ("q", "k", "v", "mask" are the op's inputs); `workspace`: forward temporaries;
    `bwd_workspace`: the backward's temporaries (besides dq, dk, dv, which have the inputs' sizes)."""

    backend: str
    outputs: tuple[Piece, ...]
    saved: tuple[str, ...]
    workspace: tuple[Piece, ...] = ()
    bwd_workspace: tuple[Piece, ...] = ()

    def piece(self, role: str) -> Piece | None:
        return next((p for p in self.outputs if p.role == role), None)


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def sdpa_kernel(backend: str, batch: int, n_head: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
                dropout: float = 0.0, torch_version: str = "2.6", *, n_kv_head: int | None = None,
                head_dim_v: int | None = None, has_mask: bool = False, requires_grad: bool = True) -> SdpaKernel:
    """What the chosen CUDA kernel allocates and saves (not "math": the caller writes torch's composite)."""
    v = sdpa_rules(torch_version)
    B, H, Hk = batch, n_head, n_head if n_kv_head is None else n_kv_head
    Dv = head_dim if head_dim_v is None else head_dim_v
    if backend == "flash":
        # attention.cpp scaled_dot_product_attention (flash, CUDA): q, k, v padded to a multiple of 8
        # (pad_last_dim<8>: new tensors only when not aligned); the output is sliced back (a view)
        Dp = _round(head_dim, 8)
        pads = (Piece("q_padded", (B, H, seq_q, Dp), dtype), Piece("k_padded", (B, Hk, seq_k, Dp), dtype),
                Piece("v_padded", (B, Hk, seq_k, Dp), dtype)) if Dp != head_dim else ()
        inputs = ("q_padded", "k_padded", "v_padded") if pads else ("q", "k", "v")
        # flash_api.cpp mha_fwd: out = empty_like(q_padded) (B, T, H, D), softmax_lse (B, H, T) fp32
        outs = pads + (Piece("out", (B, seq_q, H, Dp), dtype), Piece("logsumexp", (B, H, seq_q), "fp32"))
        saved = inputs + ("out", "logsumexp")
        workspace: tuple[Piece, ...] = ()
        if v == "2.13":
            # flash_api.cpp mha_fwd ([Note] BC breaking change to flash seed/offset, 2.7+): rng_state (2,) and
            # an unused () uint64 on the device, returned as philox seed/offset and saved by the backward
            # (derivatives.yaml); with dropout a second rng_state replaces the first (freed)
            outs += (Piece("rng_state", (2,), "int64"), Piece("rng_unused", (), "int64"))
            saved += ("rng_state", "rng_unused")
            if dropout > 0:
                workspace = (Piece("rng_state_first", (2,), "int64"),)
        # 2.6 (in-tree FA 2.5 copy): seed/offset are host tensors (at::empty({}, kLong) / scalar_tensor) unless
        # a CUDA graph is being captured: nothing on the device
        # flash_api.cpp mha_bwd: softmax_d (B, H, round128(T_q)) fp32, dq_accum (B, round128(T_q), H, d_rounded)
        # fp32 (2.6: d rounded to 32; 2.7+: to 32 up to 128, else 64), and for GQA dk/dv at the query heads
        d_round = _round(Dp, 32 if (v == "2.6" or Dp <= 128) else 64)
        bwd = (Piece("softmax_d", (B, H, _round(seq_q, 128)), "fp32"),
               Piece("dq_accum", (B, _round(seq_q, 128), H, d_round), "fp32"))
        if Hk != H:
            bwd += (Piece("dk_expanded", (B, seq_k, H, Dp), dtype), Piece("dv_expanded", (B, seq_k, H, Dp), dtype))
        return SdpaKernel("flash", outs, saved, workspace, bwd if requires_grad else ())
    if backend == "efficient":
        # attention.cu _efficient_attention_forward: res (B, T, H, Dv); logsumexp (B, H, ceil(T/32)*32) fp32 when
        # compute_log_sumexp (inputs require grad); seed/offset on the host unless capturing (both versions)
        outs = (Piece("out", (B, seq_q, H, Dv), dtype),)
        if requires_grad:
            outs += (Piece("logsumexp", (B, H, _round(seq_q, 32)), "fp32"),)
        saved = ("q", "k", "v") + (("mask",) if has_mask else ()) + ("out", "logsumexp")
        return SdpaKernel("efficient", outs, saved if requires_grad else ())
    if backend == "cudnn":
        # torch 2.13 _meta_registrations.py meta__scaled_dot_product_cudnn_attention: res (B, H, T, Dv), logsumexp
        # (B, H, T, 1) fp32, philox seed / offset on the meta device (no device bytes); k, v at their own (GQA)
        # heads, saved as they are (derivatives.yaml; seen in torch 2.13.0's ScaledDotProductCudnnAttentionBackward0
        # on the fake runtime); meta__scaled_dot_product_cudnn_backward: dq, dk, dv empty_like q, k, v (no
        # expanded GQA gradients). cuDNN's own workspace (its execution plan's) is not established (needs a GPU)
        outs = (Piece("out", (B, H, seq_q, Dv), dtype),)
        if requires_grad:
            outs += (Piece("logsumexp", (B, H, seq_q, 1), "fp32"),)
        saved = ("q", "k", "v") + (("mask",) if has_mask else ()) + ("out", "logsumexp")
        return SdpaKernel("cudnn", outs, saved if requires_grad else ())
    raise ValueError(f"sdpa_kernel: backend {backend!r} has no kernel of its own (math is torch's composite)")


# -- reductions: the global-reduction staging buffer ----------------------------------------------------------

def _last_pow2(n: int) -> int:
    # Reduce.cuh last_pow2: the largest power of two <= n (at least 1)
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def reduce_staging_bytes(num_outputs: int, inputs_per_output: int, arg_bytes: int, *, reduce_on_fastest: bool,
                         fastest_stride_is_element: bool = True, output_vec_size: int = 4, num_reduce_dims: int = 1,
                         vt0: int = 4, num_sms: int = 132, max_threads_per_sm: int = 2048,
                         max_threads: int = 512) -> tuple[int, int]:
    """(staging buffer, semaphores) bytes a CUDA reduction (gpu_reduce_kernel) allocates from the caching
    allocator and frees when it returns; (0, 0) when it reduces within blocks.

    Reduce.cuh setReduceConfig / ReduceConfig::global_memory_size, semaphore_size. `arg_bytes`: the
    accumulator's size (sum/mean of fp32: 4; max/min with indices: a (value, int64) pair, 16);
    `reduce_on_fastest`: the reduced dim has the input's smallest stride; `output_vec_size`: get_output_vec_size
    (4 halved until it divides the data pointer, the output extent and the input's strides, in elements).
    num_sms / max_threads_per_sm: the device's (H100 SXM: 132 / 2048; A100: 108 / 2048)."""
    dim0, dim1 = (inputs_per_output, num_outputs) if reduce_on_fastest else (num_outputs, inputs_per_output)
    ovs = 1
    if fastest_stride_is_element and not reduce_on_fastest:
        ovs = output_vec_size  # "vectorize along output"
        dim0 //= ovs
    elif fastest_stride_is_element and dim0 > 128 and num_reduce_dims == 1 and vt0 >= 4:
        dim0 //= 4  # "vectorize along input" (input_vec_size 4)
    mnt = max_threads // ovs  # set_block_dimension
    d0 = _last_pow2(dim0) if dim0 < mnt else mnt
    d1 = _last_pow2(dim1) if dim1 < mnt else mnt
    bw = min(d0, 32)
    bh = min(d1, mnt // bw)
    bw = min(d0, mnt // bh)
    step_in = step_out = 1
    if reduce_on_fastest:
        step_in *= bw  # input_mult[BLOCK_X]: block_x_reduce
    else:
        step_out *= bw
    split_y = -(-inputs_per_output // step_in) >= bh * 16 or -(-inputs_per_output // step_in) >= 256
    if split_y:
        step_in *= bh
    else:
        step_out *= bh
    grid = -(-(num_outputs // ovs) // step_out)
    target = num_sms * (max_threads_per_sm // (bw * bh))
    vpt = -(-inputs_per_output // step_in)
    if not (split_y and vpt >= 256 and grid <= target):
        return 0, 0
    ctas = max(min(-(-target // grid), -(-vpt // 16)), -(-vpt // 256))
    if ctas <= 1:
        return 0, 0
    size = arg_bytes * num_outputs * ctas * (1 if reduce_on_fastest else bw * ovs)
    return size, 4 * grid


def reduce_staging_of(rule: tuple) -> tuple[int, int]:
    """`reduce_staging_bytes` of a rule's arguments as a traced CUDA program records them on a reduction's two
    storages (models/traced/cuda_program.py; Storage.rule): (num_outputs, inputs_per_output, arg_bytes,
    reduce_on_fastest, fastest_stride_is_element, output_vec_size, num_sms)."""
    num_outputs, inputs, arg_bytes, on_fastest, fastest_is_element, vec, sms = rule
    return reduce_staging_bytes(num_outputs, inputs, arg_bytes, reduce_on_fastest=on_fastest,
                                fastest_stride_is_element=fastest_is_element, output_vec_size=vec, num_sms=sms)
