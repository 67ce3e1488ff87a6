"""float8 training as torchao 0.18.0 runs it eagerly: `convert_to_float8_training` swaps `nn.Linear` for
`Float8Linear` (torchao/float8/float8_linear_utils.py), whose forward is one autograd Function,
`matmul_with_hp_or_float8_args` (torchao/float8/float8_linear.py). The rules, from torchao 0.18.0's source:

- Which linears: torchtitan 0.3.0's `module_filter_fn` (torchtitan/components/quantization/utils.py): in and out
  features divisible by 16, and not the output head (`filter_fqns=["lm_head"]`, torchtitan/models/llama3/
  config_registry.py llama3_405b). Others stay bf16 nn.Linear.
- Saved for backward: `ctx.save_for_backward(input_hp, weight_hp_t)`, the high-precision input and weight in every
  recipe (float8_linear.py): the float8 copies are not saved; backward casts again. The bf16 weight is a
  parameter (nothing new), so a converted linear saves what nn.Linear saves.
- One cast (float8_scaling_utils.py `hp_tensor_to_float8_dynamic`): amax = max(abs(x)) (tensorwise) or
  amax(abs(x), dim, keepdim) (rowwise), an abs temporary of x's shape in x's dtype; the scale in fp32 (float64
  scalars on the way, float8_utils.py `amax_to_scale`); then float8_training_tensor.py `_ToFloat8ConstrFunc`:
  `x.to(float32) * scale`, `clamp` (float8_utils.py `to_fp8_saturated`) and `.to(float8)`: at its highest two
  fp32 copies of x and the float8 result are alive (`CAST_TEMPS`).
- Forward: input and weight cast to float8_e4m3fn with their scales, the matmul (`torch._scaled_mm` on a GPU,
  output bf16), the float8 copies freed when the Function's forward returns.
- Backward (one node): grad_output cast (e5m2 in tensorwise, e4m3 in rowwise), the weight cast again, grad_input
  = mm; grad_output and the input cast again (the dim for the grad_weight matmul), grad_weight = mm. The four
  float8 tensors are the backward's locals, and its bf16 grad_output its argument: alive until it returns
  (measured on the fake CUDA runtime, bench/validate_fakecuda_lowp.py). `float8_ops.py preprocess_addmm` makes
  `_scaled_mm`'s layouts: the weight copied column-major for grad_input (N x K float8), grad_output^T and the
  input copied for grad_weight; rowwise's grad gemms (use_fast_accum False) scale the output by an fp32
  outer product of the inverse scales (`addmm_float8_unwrapped` post_inverse_scale, output's shape).
- What stays bf16: the weights, their gradients (the mm output in the input's dtype), the optimizer states.
- Scales: tensorwise one fp32 scalar per cast; rowwise one fp32 per row (`axiswise_dim`, float8_linear.py
  `get_maybe_axiswise_dim`).

On the cpu profile the program is torchao's `Float8LinearConfig(emulate=True)` (the only way Float8Linear runs on a
CPU, torchtitan's `float8.emulate`): the same casts; the matmul dequantizes to fp32 and runs torch.mm inside
Float8TrainingTensor's `__torch_dispatch__` (float8_ops.py `float8_mm`), with `preprocess_addmm`'s copies. Those
inner allocations are below the tensor subclass, where a TorchDispatchMode (the tracker) does not see them: the cpu
profile leaves them out, as the measurement does; a GPU profile keeps preprocess_addmm's copies and the rowwise
post-scale (`_scaled_mm` writes its bf16 output directly). Not modelled: FSDP2's float8 all-gather
(`enable_fsdp_float8_all_gather`), torch.compile's fusion of the casts, the rowwise_with_gw_hp recipe.
"""

from __future__ import annotations

from .tape import TensorSpec

SOURCE = "torchao 0.18.0 torchao/float8/float8_linear.py"
MIN_CAPABILITY = (8, 9)  # torchtitan 0.3.0 components/quantization/float8.py: has_cuda_capability(8, 9); torchao
# 0.18.0 torchao/utils.py is_sm_at_least_89 (torch._scaled_mm's float8 kernels: Ada and Hopper)
CAST_TEMPS = 2  # fp32 copies alive at a cast's highest point: x.float() * scale, then its clamp
FP8 = {"tensorwise": {"input": "fp8_e4m3", "weight": "fp8_e4m3", "grad_output": "fp8_e5m2"},
       "rowwise": {"input": "fp8_e4m3", "weight": "fp8_e4m3", "grad_output": "fp8_e4m3"}}  # config.py recipes


def converts(name: str, in_features: int, out_features: int) -> bool:
    """torchtitan's module_filter_fn with filter_fqns=["lm_head"]: dims divisible by 16, the head excluded."""
    return in_features % 16 == 0 and out_features % 16 == 0 and "lm_head" not in name


def scale_shape(shape: tuple[int, ...], recipe: str, dim: int) -> tuple[int, ...]:
    """The fp32 scale of a cast of `shape`: a scalar (tensorwise) or one per row of `dim` kept (rowwise: amax over
    `dim` with keepdim)."""
    if recipe == "tensorwise":
        return ()
    return tuple(1 if i == dim % len(shape) else n for i, n in enumerate(shape))


def cast(name: str, shape: tuple[int, ...], dtype: str, recipe: str, dim: int) -> tuple[TensorSpec, TensorSpec,
                                                                                       tuple[TensorSpec, ...]]:
    """One `hp_tensor_to_float8_dynamic`: the float8 data, its scale, and the temporaries alive with them at the
    cast's highest point."""
    data = TensorSpec(f"{name}.fp8", tuple(shape), dtype, False)
    scale = TensorSpec(f"{name}.scale", scale_shape(tuple(shape), recipe, dim), "fp32", False)
    temps = tuple(TensorSpec(f"{name}.fp32_{i}", tuple(shape), "fp32", False) for i in range(CAST_TEMPS))
    return data, scale, temps


def backward_stages(name: str, M: int, K: int, N: int, recipe: str, act: str, gpu: bool) -> list[list[TensorSpec]]:
    """The backward node's moments, in order, each the tensors alive then beyond the gradients (grad_input from the
    third on, named `<name>.grad_input`; grad_weight in the last, `<name>.grad_weight`)."""
    dt = FP8[recipe]
    go_a, go_as, t1 = cast(f"{name}.grad_output", (M, N), dt["grad_output"], recipe, -1)
    w_b, w_bs, t2 = cast(f"{name}.weight_t", (K, N), dt["weight"], recipe, -1)
    gi = TensorSpec(f"{name}.grad_input", (M, K), act, False)
    go_c, go_cs, t3 = cast(f"{name}.grad_output_t", (M, N), dt["grad_output"], recipe, 0)
    x_d, x_ds, t4 = cast(f"{name}.input_t", (M, K), dt["input"], recipe, 0)
    gw = TensorSpec(f"{name}.grad_weight", (N, K), act, False)
    gpu_gi = [TensorSpec(f"{name}.weight_colmajor", (N, K), dt["weight"], False)] if gpu else []
    gpu_gw = [TensorSpec(f"{name}.grad_output_t_contig", (N, M), dt["grad_output"], False),
              TensorSpec(f"{name}.input_colmajor", (M, K), dt["input"], False)] if gpu else []
    if gpu and recipe == "rowwise":  # post_inverse_scale: (rows, 1) * (1, cols) fp32
        gpu_gi.append(TensorSpec(f"{name}.grad_input_post_scale", (M, K), "fp32", False))
        gpu_gw.append(TensorSpec(f"{name}.grad_weight_post_scale", (N, K), "fp32", False))
    first = [go_a, go_as]
    second = first + [w_b, w_bs]
    third = second + [gi, go_c, go_cs]
    return [first + list(t1), second + list(t2), second + gpu_gi + [gi], third + list(t3),
            third + [x_d, x_ds] + list(t4), third + [x_d, x_ds] + gpu_gw + [gw]]


def backward_workspaces(name: str, M: int, K: int, N: int, recipe: str, act: str, gpu: bool,
                        input_grad: bool = True) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The node's temporaries at its highest moment up to grad_input's matmul and the casts after it, and at the
    grad_weight matmul, besides the gradients the replay makes itself (grad_input is the input's gradient,
    grad_weight the weight's). Where the input needs no gradient (an MLP's batch), torchao's backward makes
    grad_input all the same (it does not read ctx.needs_input_grad) and autograd drops it: a temporary here."""
    stages = backward_stages(name, M, K, N, recipe, act, gpu)
    top = max(stages[:-1], key=lambda s: sum(t.nbytes for t in s))
    grads = (f"{name}.grad_input", f"{name}.grad_weight") if input_grad else (f"{name}.grad_weight",)
    # the node's grad_output (bf16, its argument) is alive until the node returns, through the grad_weight matmul;
    # the replay frees it after the first of the two replay nodes, so the second holds a tensor of its bytes
    held = TensorSpec(f"{name}.grad_output_held", (M, N), act, False)
    return tuple(t for t in top if t.name not in grads), tuple(t for t in stages[-1] if t.name not in grads) + (held,)


def write_linear(w, name: str, x: TensorSpec, out_features: int, bias: bool, weight: str | None) -> TensorSpec:
    """`TapeWriter.linear` for a Float8Linear: the input's and the weight's casts (own ops: their temporaries
    come and go before the matmul), the matmul saving the bf16 input, and the bias added after it."""
    recipe = w.setup.float8.recipe
    weight = weight or f"{name}.weight"
    *lead, K = x.shape
    M = 1
    for n in lead:
        M *= n
    N = out_features
    dt = FP8[recipe]
    x8, xs, xt = cast(f"{name}.input", x.shape, dt["input"], recipe, -1)
    w.op(f"{name}.input_cast", "float8_cast", [x], [x8, xs], workspace=xt)
    w8, ws, wt = cast(f"{name}.weight", (K, N), dt["weight"], recipe, 0)  # weight.t(): (in, out), column-major
    main_bwd, weight_bwd = backward_workspaces(name, M, K, N, recipe, x.dtype, gpu=not w.cpu,
                                               input_grad=x.requires_grad)
    # The weight's cast carries the weight: its backward node (run right after the matmul's, the tape's order
    # reversed) makes the weight's gradient at the node's last moment, grad_weight's matmul, with the four float8
    # tensors still alive; the matmul's node makes grad_input. One torch node, two replay nodes, in its order.
    w8 = TensorSpec(w8.name, w8.shape, w8.dtype, True)
    # Where the input needs no gradient (an MLP's first layer), the node runs because the weight needs one: the
    # matmul reads an empty stand-in of the weight, whose "gradient" links the two replay nodes and holds no bytes
    # (the CUDA and CPU runs hold nothing there: bench/validate_fakecuda_lowp.py).
    link = () if x.requires_grad else (TensorSpec(f"{name}.weight_link", (0,), "fp32", True),)
    w.op(f"{name}.weight_cast", "float8_cast", [], [w8, ws, *link], workspace=wt, params=(weight,),
         bwd_workspace=weight_bwd)
    out = w.t(f"{name}.out", (*lead, N))
    (y,) = w.op(name, "float8_linear", [x, x8, xs, *link], [out], saves=(x.name,),
                releases=(w8.name, ws.name, *(t.name for t in link)),
                saved_params=(weight,), bwd_workspace=main_bwd, flops=2 * M * K * N)
    if not bias:
        return y
    # Float8Linear.forward: `output + self.bias.to(output.dtype)`, a new tensor; the matmul's output goes
    (z,) = w.op(f"{name}.bias_add", "add", [y], [w.t(f"{name}.biased", y.shape)], params=(f"{name}.bias",),
                passthrough=True, flops=M * N)
    return z


def check_device(recipe: str, cpu: bool, compute_capability: tuple[int, int] | None, device_name: str) -> str | None:
    """None where `recipe` runs on the device, else why not (torch._scaled_mm's float8 kernels need sm 8.9+;
    the cpu profile is torchao's emulation)."""
    if recipe == "none" or cpu:
        return None
    if compute_capability is None or tuple(compute_capability) < MIN_CAPABILITY:
        have = "not a CUDA GPU" if compute_capability is None else "sm" + "".join(map(str, compute_capability))
        return (f"float8 training needs a GPU of compute capability >= 8.9 (torch._scaled_mm: H100, H200, L40S, "
                f"RTX 4090), {device_name} is {have}; or the cpu profile (torchao's emulate=True)")
    return None
