"""The tape writer every hand-written transformer describer uses: `TapeWriter` appends ops with what they
save, marks each with its layer's checkpointing (regions, op-policy's cache, offload) and autocast's casts, and
tracks the tensors Python keeps alive; `module_return` ends a module's locals.
"""

from __future__ import annotations

import contextlib

from .. import float8, lora
from ..config import TrainingSetup
from ..tape import SAC_SAVED_KINDS, Segment, Tape, TensorSpec


class TapeWriter:
    """Small helper that knows B, T and the dtypes, so the block code reads like the model."""

    def __init__(self, tape: Tape, setup: TrainingSetup, cpu: bool = False) -> None:
        self.tape = tape
        self.setup = setup
        self.cpu = cpu
        self.autocast = setup.precision.autocast is not None
        self.act = setup.precision.compute
        self.region: int | None = None
        self.core_region: int | None = None  # "selective": the region of this layer's attention core
        self.sac = False  # "op-policy": matmul and SDPA outputs are kept by the region's first pass
        self.offload = False  # "offload": saved tensors go to the host
        self.streams = False  # activation_offload "streams": under torchtune's OffloadActivations (the whole forward)
        self.lora_targets: tuple[str, ...] = ()  # setup.lora.r > 0: peft target_modules (models/lora.py)
        self.fused_rms_norm = False  # nn.RMSNorm runs CUDA's fused kernel (models/gpu.py `cuda_fused_rms_norm`)
        self.torch_version = "2.6"  # on a GPU: whose SDPA kernel rules (models/transformer/attention.py GPU_TARGET)

    def begin_layer(self, segment: Segment, layer: int) -> None:
        """The ops written next belong to `layer` of `segment`: mark them as its policy says."""
        self.region = segment.layers.start if segment.wrap in ("checkpoint", "op-policy") else None
        self.core_region = layer if segment.wrap == "selective" else None
        self.sac = segment.wrap == "op-policy"
        self.offload = segment.wrap == "offload"

    def end_layers(self) -> None:
        self.region, self.core_region, self.sac, self.offload = None, None, False, False

    @contextlib.contextmanager
    def attention_core(self):
        """The attention core (scores to @ v, or the SDPA op): under "selective", its own checkpoint region."""
        if self.core_region is None:
            yield
            return
        self.region = self.core_region
        try:
            yield
        finally:
            self.region = None

    def fp32_op_dtype(self) -> str:
        """dtype of ops autocast keeps in fp32 (norms, softmax, embedding, loss)."""
        return "fp32" if self.autocast else self.act

    def softmax_dtype(self, x: TensorSpec) -> str:
        """CUDA autocast runs softmax in fp32; CPU autocast has no softmax rule: it keeps its input dtype."""
        return x.dtype if (self.cpu or not self.autocast) else "fp32"

    def autocast_input(self, name: str, x: TensorSpec) -> TensorSpec:
        """Autocast casts an fp32 input of a 16-bit op (linear, matmul) to a new 16-bit tensor; the op
        saves that copy, not the fp32 input (casts of non-leaf tensors are not cached: each op makes its own)."""
        if not self.autocast or x.dtype == self.act:
            return x
        (y,) = self.op(f"{name}.autocast_input", "to_copy", [x], [self.t(f"{name}.in_cast", x.shape, self.act)])
        return y

    def t(self, name: str, shape, dtype: str | None = None, requires_grad: bool = True) -> TensorSpec:
        return TensorSpec(name, tuple(shape), dtype or self.act, requires_grad)

    def op(self, name, kind, inputs, outputs, **kw):
        kw.setdefault("region", self.region)
        if self.sac and kind in SAC_SAVED_KINDS:
            kw.setdefault("cached", True)
        if self.offload or self.streams:
            kw.setdefault("offloaded", True)
        return self.tape.add(name, kind, [i.name if isinstance(i, TensorSpec) else i for i in inputs],
                             outputs, **kw)

    def linear(self, name: str, x: TensorSpec, out_features: int, bias: bool, weight: str | None = None,
               adapter: bool = False):
        if self.setup.lora.r and not adapter:  # LoRA / QLoRA: frozen or 4-bit base, adapters (models/lora.py)
            return lora.write_linear(self, name, x, out_features, bias, weight)
        if (self.setup.float8.recipe != "none" and not adapter
                and float8.converts(name, x.shape[-1], out_features)):  # torchao Float8Linear (models/float8.py)
            return float8.write_linear(self, name, x, out_features, bias, weight)
        weight = weight or f"{name}.weight"
        params = (weight, f"{name}.bias") if bias else (weight,)
        in_features = x.shape[-1]
        rows = x.shape[0] * x.shape[1]
        x = self.autocast_input(name, x)
        (y,) = self.op(name, "linear", [x],
                       [self.t(f"{name}.out", (*x.shape[:-1], out_features), x.dtype if adapter else None)],
                       saves=(x.name,), params=params, casts=params if self.autocast else (),
                       saved_params=(weight,), flops=2 * rows * in_features * out_features)
        return y

    def layernorm(self, name: str, x: TensorSpec, bias: bool = True):
        """nn.LayerNorm: saves input, mean and rstd (one per row). On a CPU mean and rstd take the
        output's dtype (16-bit in pure bf16); CUDA keeps them fp32."""
        B, T, D = x.shape
        dt = self.fp32_op_dtype()
        stats = dt if self.cpu else "fp32"
        y, mean, rstd = self.op(name, "layernorm", [x],
                                [self.t(f"{name}.out", x.shape, dt), self.t(f"{name}.mean", (B, T, 1), stats, False),
                                 self.t(f"{name}.rstd", (B, T, 1), stats, False)],
                                saves=(x.name, f"{name}.mean", f"{name}.rstd"),
                                params=(f"{name}.weight", f"{name}.bias") if bias else (f"{name}.weight",),
                                saved_params=(f"{name}.weight", f"{name}.bias") if bias else (f"{name}.weight",),
                                flops=8 * B * T * D)
        return y

    def rmsnorm(self, name: str, x: TensorSpec):
        """torch's composite RMSNorm (nn.RMSNorm on CPU, HF's LlamaRMSNorm): x * rsqrt(mean(x^2) + eps)
        keeps x and rstd for its backward, and the normalised x for the multiply by the weight. Saved
        per node: pow saves x, rsqrt its result, x * rstd both again, the weight product normed.

        A 16-bit input outside autocast on a CPU: the composite (torch 2.13 `rms_norm`) upcasts first, so
        what pow and x * rstd save is `x.float()`, the normalised x and its product with the weight are
        fp32 (the weight multiply saves the former; the latter lives until `type_as` casts the result
        back), and the backward holds three more fp32 tensors of x's shape at its highest point
        (PowBackward's, measured with the tracker). A GPU runs nn.RMSNorm as a fused kernel in torch
        2.13 and HF's LlamaRMSNorm casts back before the weight: neither is measured here, and a GPU
        profile keeps the first form.

        Where `fused_rms_norm` says so (nn.RMSNorm on CUDA under torch 2.11), the fused kernel instead: the output
        and the fp32 rstd (one per row) only; its backward keeps the input and rstd (models/gpu.py
        `cuda_fused_rms_norm`)."""
        B, T, D = x.shape
        dt = self.fp32_op_dtype()
        if self.fused_rms_norm:
            y, _ = self.op(name, "rmsnorm", [x], [self.t(f"{name}.out", x.shape, dt),
                                                  self.t(f"{name}.rstd", (B, T, 1), "fp32", False)],
                           saves=(x.name, f"{name}.rstd"), params=(f"{name}.weight",),
                           saved_params=(f"{name}.weight",), flops=6 * B * T * D)
            return y
        # a frozen weight (LoRA freezes every norm): `normed * weight` saves normed only for the weight's gradient
        weight_grad = () if self.lora_targets else (f"{name}.normed",)
        if self.cpu and dt != "fp32":
            up, rstd, normed = f"{name}.upcast", f"{name}.rstd", f"{name}.normed"
            y, *_ = self.op(name, "rmsnorm", [x], [self.t(f"{name}.out", x.shape, dt),
                                                   self.t(rstd, (B, T, 1), "fp32", False),
                                                   self.t(up, x.shape, "fp32", False),
                                                   self.t(normed, x.shape, "fp32", False)],
                            saves=(up, rstd, rstd, up) + weight_grad, params=(f"{name}.weight",),
                            saved_params=(f"{name}.weight",), flops=6 * B * T * D,
                            workspace=(self.t(f"{name}.weighted", x.shape, "fp32", False),),
                            bwd_workspace=tuple(self.t(f"{name}.grad_temp{i}", x.shape, "fp32", False)
                                                for i in range(3)))
            return y
        y, rstd, normed = self.op(name, "rmsnorm", [x], [self.t(f"{name}.out", x.shape, dt),
                                                         self.t(f"{name}.rstd", (B, T, 1), "fp32", False),
                                                         self.t(f"{name}.normed", x.shape, dt, False)],
                                  saves=(x.name, f"{name}.rstd", f"{name}.rstd", x.name) + weight_grad,
                                  params=(f"{name}.weight",),
                                  saved_params=(f"{name}.weight",), flops=6 * B * T * D)
        return y

    def dropout(self, name: str, x: TensorSpec, p: float):
        """nn.Dropout in training mode; p = 0 returns its input. The mask is saved: on a CPU a tensor of
        the input's dtype (torch's CPU dropout multiplies by a scaled noise tensor), on CUDA a bool mask."""
        if p <= 0:
            return x
        mask_dtype = x.dtype if self.cpu else "bool"
        y, mask = self.op(name, "dropout", [x], [self.t(f"{name}.out", x.shape, x.dtype),
                                                 self.t(f"{name}.mask", x.shape, mask_dtype, False)],
                          saves=(f"{name}.mask",), flops=x.shape[0] * x.shape[1] * x.shape[-1])
        return y

    def add(self, name: str, a: TensorSpec, b: TensorSpec):
        dt = "fp32" if "fp32" in (a.dtype, b.dtype) else a.dtype
        (y,) = self.op(name, "add", [a, b], [self.t(name, a.shape, dt)], passthrough=True)
        return y

    def pointwise(self, name: str, kind: str, x: TensorSpec):
        """Activation functions. ReLU's backward needs only its result; GELU and SiLU need the input."""
        out = f"{name}.out"
        (y,) = self.op(name, kind, [x], [self.t(out, x.shape, x.dtype)], saves=(out,) if kind == "relu" else (x.name,))
        return y


def module_return(w: TapeWriter, module: str, x: TensorSpec, *locals_: TensorSpec) -> None:
    """A module's `forward(x)` argument and its locals stay referenced by its Python frame until it returns. That
    outlives their last use where nothing saves them: the input under LoRA (models/lora.py `module_return`) and,
    on a GPU, under autocast (the linears save their 16-bit casts, aten/src/ATen/autocast_mode.cpp, not the fp32
    input), and the `locals_` the caller names (on a GPU; CPU tapes are kept as validated)."""
    held = ([x] if w.lora_targets or (w.autocast and not w.cpu) else []) + ([] if w.cpu else list(locals_))
    if held:
        w.op(f"{module}.return", "release", held, [])
