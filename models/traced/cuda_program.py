"""The CUDA program recorded on the CPU: what torch dispatches differently when the tensors are on a CUDA device.

The recorder (record.py) runs the model on fake CPU tensors: the ops it sees are the ones torch runs for CPU
tensors. Where the model will train on a CUDA GPU, three decisions torch takes at dispatch time differ, and
they change which tensors exist, their dtypes and what autograd saves. `cuda_program` makes the CPU run take
the CUDA decision at the same dispatch level, while it records, so the recording is the GPU program's:

- autocast: CUDA's op lists (aten/src/ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP / FP32 /
  FP32_SET_OPT_DTYPE / PROMOTE / DIFFERENT_REDISPATCH_SIGNATURE, torch 2.13) replace the CPU's: each op with
  an AutocastCPU or AutocastCUDA kernel gets, on the AutocastCPU key, a kernel applying the CUDA policy
  (WrapFunction_ in autocast_mode.h: lower_precision_fp casts floating inputs to the autocast dtype, caching
  the casts of fp32 leaf parameters as `cached_cast` does until the outermost autocast exits; fp32 casts them
  to fp32; fp32_set_opt_dtype sets an unset `dtype` to fp32 when the first input is floating; fp32_append_dtype
  redispatches norm with dtype fp32; promote casts to the widest floating type), or none (ops only CPU
  autocasts). Casts are made above autograd, as autocast makes them, so autograd records and saves them.
  Example: GPT-2's `gelu_new` computes `pow(x, 3)` in fp32 on CUDA (pow is in FP32) and in bf16 on the CPU.
- dropout: `aten::dropout` runs the fused `native_dropout` on CUDA (Dropout.cpp `dropout`:
  is_fused_kernel_acceptable: a CUDA input, 0 < p < 1, not empty), which saves a bool mask; the CPU path saves
  a noise tensor of the input's dtype.
- scaled_dot_product_attention: the backend `select_sdp_backend` picks on CUDA (models/gpu.py `sdpa_backend`,
  from sdp_utils.cpp) replaces the CPU's choice, and the op runs as attention.cpp `scaled_dot_product_attention`
  runs it for CUDA tensors: flash (inputs padded to a multiple of 8 in the head dim, `pad_last_dim<8>`),
  memory-efficient (a boolean mask converted to an additive one, `convert_boolean_attn_mask`, padded where its
  strides are not aligned to 8, `preprocess_mask`), cuDNN (its own mask conversion) or the math composite
  (`_scaled_dot_product_attention_math`, whose dropout is then the CUDA dropout above). The fused kernels'
  outputs and saved tensors come from their fake (meta) kernels; their backward temporaries, which no meta
  kernel shows, are added on the tape (gpu_paths.py).

- reductions' global staging: a CUDA sum / mean / max-with-indices that splits its reduced dimension over several
  blocks allocates a staging buffer and semaphores from the caching allocator after its output and frees them
  as it returns (Reduce.cuh setReduceConfig / global_memory_size; models/gpu.py `reduce_staging_bytes`), e.g.
  the bias gradient of every nn.Linear (`grad.sum(0)`); `temporaries` gives them to the recorder, from the
  input's real strides, for the reductions TensorIterator coalesces to one reduced and at most one kept dim.

Not changed (the CPU kernels' outputs are what the CUDA kernels return): every other op. Known composite
branches on `is_cuda()` left out: fp16 softmax / log_softmax with dtype fp32 (`half_to_float`, fp16 only).

The overrides are torch.library registrations held only while recording (`Library._destroy` removes them), so
the real CPU runs of `validate` keep the CPU program.
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch

from ..gpu import kernel_rules, reduce_staging_of, sdpa_backend, sdpa_cudnn
from .realpath import tensors_in

# autocast_mode.h (torch 2.13): the CUDA policy of every op AutocastCUDA registers ("aten::name.overload")
LOWER = ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
         "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
         "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
         "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
         "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
         "cudnn_convolution", "cudnn_convolution_transpose")  # (the last two: autocast_mode.cpp, KERNEL_CUDA)
FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                      "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                      "sum.dim_IntList")
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)  # autocast_mode.cpp binary_cross_entropy_banned
POLICY = {**{n: "lower" for n in LOWER}, **{n: "fp32" for n in FP32},
          **{n: "fp32_set_opt_dtype" for n in FP32_SET_OPT_DTYPE},
          **{n: "fp32_append_dtype" for n in FP32_APPEND_DTYPE},
          **{n: "promote" for n in PROMOTE}, **{n: "banned" for n in BANNED}}

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _overload(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _eligible(t) -> bool:
    # autocast_mode.h is_eligible: a defined floating tensor of the device, not double
    return isinstance(t, torch.Tensor) and t.dtype in _FLOATS


class _CastCache:
    """autocast_mode.cpp `cached_casts`: the lower-precision copies of fp32 leaf tensors that require grad,
    kept until the outermost autocast region exits (torch.autocast.__exit__ -> torch.clear_autocast_cache)."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.on_cached = None  # called with each cast the cache holds (the recorder notes its storage)

    def cast(self, t, to: torch.dtype, lower: torch.dtype):
        if not _eligible(t) or t.dtype == to:
            return t
        cacheable = (to == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return t.to(to)
        hit = self.casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(to)
        self.casts[id(t)] = (weakref.ref(t), out)
        if self.on_cached is not None:
            self.on_cached(out)
        return out

    def clear(self) -> None:
        self.casts.clear()


def _cast_all(args, kwargs, fn):
    """(args, kwargs) with `fn` applied to each tensor (and each tensor of a list), the last argument first:
    WrapFunction_ casts them in one expansion of the argument pack, `(*F)(cached_cast(..., args, ...)...)`, whose
    order C++ leaves to the compiler; GCC, which builds torch's Linux wheels, evaluates it right to left (seen on
    the H200: a linear's bf16 weight copy is allocated before its input's)."""
    def one(a):
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(reversed([fn(x) if isinstance(x, torch.Tensor) else x for x in reversed(a)]))
        return fn(a) if isinstance(a, torch.Tensor) else a
    values = list(args) + list(kwargs.values())
    done = [one(a) for a in reversed(values)][::-1]
    return done[:len(args)], dict(zip(kwargs, done[len(args):]))


def _autocast_kernel(op, policy: str, cache: _CastCache, redispatch=None):
    """The CUDA policy of one op (autocast_mode.h WrapFunction_), as an AutocastCPU kernel."""
    names = [a.name for a in op._schema.arguments]
    dtype_at = names.index("dtype") if "dtype" in names else None
    composite = policy == "none" and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                                                  "CompositeImplicitAutograd")

    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy == "banned":
                raise RuntimeError(f"{op._schema.name} is unsafe to autocast (autocast_mode.cpp "
                                   "binary_cross_entropy_banned): use binary_cross_entropy_with_logits")
            if policy == "lower":
                a, k = _cast_all(args, kwargs, lambda t: cache.cast(t, lower, lower))
                return op(*a, **k)
            if policy == "fp32":
                a, k = _cast_all(args, kwargs, lambda t: cache.cast(t, torch.float32, lower))
                return op(*a, **k)
            if policy == "fp32_set_opt_dtype":
                if args and _eligible(args[0]):
                    args = list(args)
                    if dtype_at is not None and dtype_at < len(args) and "dtype" not in kwargs:
                        args[dtype_at] = torch.float32 if args[dtype_at] is None else args[dtype_at]
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == "fp32_append_dtype":
                first = args[0]
                return redispatch(*args, **kwargs, dtype=torch.float32 if _eligible(first) else first.dtype)
            if policy == "promote":
                to = lower
                for t in tensors_in((args, kwargs)):
                    if _eligible(t) and t.dtype != lower:
                        to = torch.promote_types(to, t.dtype)
                a, k = _cast_all(args, kwargs, lambda t: cache.cast(t, to, lower))
                return op(*a, **k)
            if not composite:
                return op(*args, **kwargs)
        # an op only CPU autocast registers: on CUDA its autocast kernel is the fallthrough, so a composite op's
        # inner ops meet autocast again (cross_entropy_loss's log_softmax and nll_loss)
        return op.decompose(*args, **kwargs)

    return kernel


def _dropout(input, p, train):
    # Dropout.cpp `dropout`: the fused kernel on a CUDA input (is_fused_kernel_acceptable), else `_dropout`
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    return torch.ops.aten.dropout.default.decompose(input, p, train)


def _pad_last_dim(t: torch.Tensor, align: int) -> torch.Tensor:
    # attention.cpp pad_last_dim<8, false>
    extra = t.shape[-1] % align
    return t if extra == 0 else torch.nn.functional.pad(t, (0, align - extra))


def _aligned(mask: torch.Tensor, align: int) -> bool:
    # attention.cpp aligned_tensor<alignment>
    return all(mask.stride(i) % align == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1


def _boolean_mask_additive(mask, dtype, fill: float):
    # attention.cpp convert_boolean_attn_mask (fill -inf) / convert_boolean_attn_mask_cudnn (fill -65504)
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype))


class _Sdpa:
    """attention.cpp `scaled_dot_product_attention` for CUDA tensors, the backend from models/gpu.py."""

    def __init__(self, compute_capability: tuple[int, int], rules: str, cudnn_version: int | None = None,
                 cuda_major: int = 12) -> None:
        self.cc, self.rules = compute_capability, rules
        self.cudnn = (cudnn_version, cuda_major)  # the release's wheel's (models/gpu.py `sdpa_cudnn`)
        self.backends: list[str] = []  # what each call ran, in order (the recording reports them)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                 enable_gqa=False):
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(query.dtype)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        # sdp_utils_cpp.h check_last_dim_stride_equals_1_dense (a head dim of 1 is ignored for q, k, v)
        contiguous = all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (query, key, value)) and (
            attn_mask is None or attn_mask.stride(-1) == 1)
        backend = "math" if dtype is None or query.dim() != 4 else sdpa_backend(
            dtype, query.shape[-1], dropout_p, attn_mask is not None, is_causal, self.cc, self.rules,
            head_dim_v=value.shape[-1], seq_q=query.shape[-2], seq_k=key.shape[-2], n_head=query.shape[-3],
            n_kv_head=key.shape[-3], enable_gqa=enable_gqa, requires_grad=grad, last_dims_contiguous=contiguous,
            cudnn_version=self.cudnn[0], cuda_major=self.cudnn[1])
        self.backends.append(backend)
        aten = torch.ops.aten
        if backend == "flash":
            size = query.shape[-1]
            og_scale = scale if scale is not None else 1.0 / math.sqrt(size)  # sdp::calculate_scale
            out = aten._scaled_dot_product_flash_attention.default(
                _pad_last_dim(query, 8), _pad_last_dim(key, 8), _pad_last_dim(value, 8), dropout_p, is_causal,
                False, scale=og_scale)[0]
            return out if out.shape[-1] == size else out[..., :size]  # post_process_flash_output
        if backend == "efficient":
            mask = _boolean_mask_additive(attn_mask, query.dtype, -math.inf)
            if mask is not None:  # preprocess_mask
                if not _aligned(mask, 8):
                    last = mask.shape[-1]
                    mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
                mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return aten._scaled_dot_product_efficient_attention.default(query, key, value, mask, grad, dropout_p,
                                                                       is_causal, scale=scale)[0]
        if backend == "cudnn":
            mask = _boolean_mask_additive(attn_mask, query.dtype, -65504.0)
            return aten._scaled_dot_product_cudnn_attention.default(query, key, value, mask, grad, dropout_p,
                                                                   is_causal, False, scale=scale)[0]
        mask = _boolean_mask_additive(attn_mask, query.dtype, -math.inf)
        return aten._scaled_dot_product_attention_math.default(query, key, value, mask, dropout_p, is_causal, None,
                                                               scale=scale, enable_gqa=enable_gqa)[0]


SMS = {(9, 0): 132, (8, 0): 108}  # streaming multiprocessors of the H100 / H200 (SXM) and A100 profiles
REDUCTIONS = {"sum.dim_IntList": 4, "sum.default": 4, "mean.dim": 4, "mean.default": 4, "max.dim": 16,
              "min.dim": 16}  # accumulator bytes of a floating input: float (at::acc_type), max/min a (value, index)


def reduction_temporaries(func, args, kwargs, compute_capability) -> tuple[tuple[int, str, tuple], ...]:
    """The staging buffer and semaphores of a CUDA reduction (module docstring), (bytes, role, the rule's
    arguments) each, or () where it reduces within blocks, is not one of REDUCTIONS, or its layout does not
    coalesce to one reduced and one kept dimension."""
    name = f"{func._schema.name.split('::')[-1]}.{func._overloadname}"
    arg_bytes = REDUCTIONS.get(name)
    sms = SMS.get(tuple(compute_capability))
    x = args[0] if args else None
    if arg_bytes is None or sms is None or not isinstance(x, torch.Tensor) or x.dim() == 0:
        return ()
    if not x.dtype.is_floating_point:
        return ()
    if x.dtype == torch.float64:
        arg_bytes *= 2
    dims = args[1] if len(args) > 1 and name != "max.dim" and name != "min.dim" else kwargs.get("dim")
    if name in ("max.dim", "min.dim"):
        dims = [args[1]]
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        dims = list(range(x.dim()))
    dims = {d % x.dim() for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    # TensorIterator: size-1 dims dropped, dims ordered by input stride (fastest first), neighbours coalesced
    # when one continues the other and both are reduced or both kept
    axes = sorted(((x.stride(d), x.shape[d], d in dims) for d in range(x.dim()) if x.shape[d] != 1))
    merged: list[list] = []
    for stride, size, reduced in axes:
        if merged and merged[-1][2] == reduced and merged[-1][0] * merged[-1][1] == stride:
            merged[-1][1] *= size
        else:
            merged.append([stride, size, reduced])
    kept = [m for m in merged if not m[2]]
    red = [m for m in merged if m[2]]
    if len(red) != 1 or len(kept) > 1:
        return ()
    num_outputs = kept[0][1] if kept else 1
    inputs = red[0][1]
    on_fastest = merged[0][2]
    vec = 4  # get_output_vec_size: halved until it divides the output extent and the other strides
    while vec > 1 and (num_outputs % vec or any(m[0] % vec for m in merged if m[0] != 1)):
        vec //= 2
    rule = (num_outputs, inputs, arg_bytes, on_fastest, merged[0][0] == 1, vec, sms)
    size, semaphores = reduce_staging_of(rule)
    return ((size, "reduce_staging", rule), (semaphores, "reduce_semaphores", rule)) if size else ()


class cuda_program:
    """While active (around a recording on fake CPU tensors), torch dispatches as it does for CUDA tensors on a
    GPU of `compute_capability` under the kernel rules of `torch_version` (module docstring). `backends` lists
    the SDPA backend of every attention call."""

    # autograd's branches for real tensors (real_branches.py): a GPU run has no dispatch
    # mode, under which torch treats every tensor as a subclass (c10 isTensorSubclassLike)
    real_tensor_branches = True

    def __init__(self, compute_capability: tuple[int, int], torch_version: str = "2.6") -> None:
        self.cc = tuple(compute_capability)
        self.sdpa = _Sdpa(self.cc, kernel_rules(torch_version), *sdpa_cudnn(torch_version))
        self.cache = _CastCache()

    @property
    def backends(self) -> list[str]:
        return self.sdpa.backends

    def temporaries(self, func, args, kwargs, out) -> tuple[tuple[int, str, tuple], ...]:
        """What the CUDA kernel of an aten call allocates and frees inside itself, after its outputs."""
        return reduction_temporaries(func, args, kwargs or {}, self.cc)

    def __enter__(self):
        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            cpu_only = {n.removeprefix("aten::") for n in
                        torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")} - set(POLICY)
            for name, policy in [*POLICY.items(), *((n, "none") for n in sorted(cpu_only))]:
                op = _overload(name)
                if op is None:
                    continue
                target = _overload(FP32_APPEND_DTYPE[name]) if policy == "fp32_append_dtype" else None
                self.lib.impl(name, _autocast_kernel(op, policy, self.cache, target), "AutocastCPU")
            self.lib.impl("dropout", _dropout, "AutogradCPU")
            self.lib.impl("scaled_dot_product_attention", self.sdpa, "AutogradCPU")
        self.clear_autocast_cache = torch.clear_autocast_cache

        def clear():  # torch.autocast.__exit__ at the outermost region: autocast's cache ends there
            self.cache.clear()
            self.clear_autocast_cache()

        torch.clear_autocast_cache = clear
        return self

    def __exit__(self, *exc):
        torch.clear_autocast_cache = self.clear_autocast_cache
        self.cache.clear()
        self.lib._destroy()
        return False


__all__ = ["cuda_program", "POLICY"]
