"""Analytic describer for decoder-only transformers (GPT-2 and Llama families) and MLPs.

It writes the forward tape of one micro-batch in the order torch runs it, naming parameters as
`named_parameters()` does (nanoGPT names for gpt2, HF names for llama) and listing each saved
activation with its shape and dtype. What each op saves follows torch's autograd formulas:

- Linear saves its input (the weight is a parameter, not new memory); bias adds nothing.
- LayerNorm saves input, mean and rstd (fp32, one per row); RMSNorm (torch's composite, as nn.RMSNorm
  runs on CPU) saves input, rstd and the normalised input.
- GELU / SiLU save their input, ReLU its output; an elementwise product saves both factors; residual adds save nothing.
- Dropout (p > 0) saves a bool mask and its output feeds the next op.
- Eager attention (nanoGPT): q and k are copied contiguous for the batched matmul and saved, the
  B*heads*T*T scores are masked, the softmax output is saved (plus the dropout mask and output), v is
  copied and saved, and the head-merged output is copied contiguous. SDPA/flash saves q, k, v (views
  of the projection), its output and the logsumexp (B*heads*T, fp32) only. On a CUDA profile SDPA is the
  kernel torch picks there (models/gpu.py `sdpa_backend`, for `GPU_TARGET`) with what it allocates and saves
  (`sdpa_kernel`): flash's logsumexp, padded copies and backward workspaces, memory-efficient attention's
  logsumexp padded to 32 rows; where CUDA falls back to the math backend (fp32 with GQA on torch 2.6, head
  dims no fused kernel takes) the nanoGPT/Llama writer writes eager attention, an approximation of torch's
  composite (which also keeps scaled copies of q and k and a (T, T) float mask), and the HF writer the
  composite itself (`_hf_sdpa_math`).
- Cross-entropy: log_softmax output (B*T*vocab, fp32 under autocast) is saved; the caller holds the
  logits until backward ends (`TrainingSetup.logits_held`).

`implementation="hf"` (HF transformers' GPT2LMHeadModel, read from a config.json) has its own tape,
`hf_gpt2_tape`, at the end of the transformer section: same parameters, different allocations (Conv1D,
an additive float mask, CPU dropout masks in the input's dtype, "gelu_new" op by op, HF's loss, and
tensors kept alive by Python locals until their module returns).

Activation checkpointing: the layers are written segment by segment (`models.tape.checkpoint_segments`)
and the writer marks each op with what the segment's policy does to it (`_Writer.begin_layer`): the
checkpoint region it belongs to (whole layers, or only the attention core under "selective"),
whether op-policy's selective checkpointing keeps its outputs (`TapeOp.cached`, matmul and SDPA ops),
or whether what it saves is offloaded to the host (`TapeOp.offloaded`). `models/autograd.py` replays them.

Under torch.autocast, linears and matmuls run in 16-bit: their weights and biases are cast (autocast
caches the copies until the forward ends; the weight's is saved for backward, and 16-bit gradients are
turned fp32 by a separate node), and an fp32 input is cast to a new 16-bit tensor that the linear saves
instead of the fp32 input (the final norm's fp32 output stays alive until the model returns).
Embeddings, norms and the loss produce fp32 (the loss reads a temporary fp32 copy of the 16-bit
logits); softmax is fp32 under CUDA autocast but keeps its 16-bit input dtype under CPU autocast
(`describe(..., "cpu")`). A residual add of fp32 and 16-bit tensors is fp32, and its backward casts the
gradient for the 16-bit input.
"""

from __future__ import annotations

import contextlib

from . import gpu, lora
from .config import ConfigError, MLPConfig, TrainingSetup, TransformerConfig
from .moe import moe_params
from .tape import SAC_SAVED_KINDS, ParamSpec, Segment, Tape, TensorSpec, checkpoint_segments


class _Writer:
    """Small helper that knows B, T and the dtypes, so the block code reads like the model."""

    def __init__(self, tape: Tape, setup: TrainingSetup, cpu: bool = False) -> None:
        self.tape = tape
        self.setup = setup
        self.cpu = cpu
        self.autocast = setup.precision.endswith("-autocast")
        self.act = setup.compute_dtype
        self.region: int | None = None
        self.core_region: int | None = None  # "selective": the region of this layer's attention core
        self.sac = False  # "op-policy": matmul and SDPA outputs are kept by the region's first pass
        self.offload = False  # "offload": saved tensors go to the host
        self.lora_targets: tuple[str, ...] = ()  # setup.lora_r > 0: peft target_modules (models/lora.py)
        self.fused_rms_norm = False  # nn.RMSNorm runs CUDA's fused kernel (models/gpu.py `cuda_fused_rms_norm`)

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
        if self.offload:
            kw.setdefault("offloaded", True)
        return self.tape.add(name, kind, [i.name if isinstance(i, TensorSpec) else i for i in inputs],
                             outputs, **kw)

    def linear(self, name: str, x: TensorSpec, out_features: int, bias: bool, weight: str | None = None,
               adapter: bool = False):
        if self.setup.lora_r and not adapter:  # LoRA / QLoRA: frozen or 4-bit base, adapters (models/lora.py)
            return lora.write_linear(self, name, x, out_features, bias, weight)
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


def transformer_params(cfg: TransformerConfig) -> list[ParamSpec]:
    """Parameters in registration order; a tied output embedding is not listed twice."""
    D, F, V = cfg.d_model, cfg.ffn, cfg.vocab_size
    kv, A = cfg.kv_heads * cfg.head_size, cfg.attn_dim
    ps: list[ParamSpec] = []
    if cfg.family == "gpt2":
        ps += [ParamSpec("transformer.wte.weight", (V, D)), ParamSpec("transformer.wpe.weight", (cfg.max_seq_len, D))]
        for i in range(cfg.n_layer):
            h = f"transformer.h.{i}"
            ps += _norm(f"{h}.ln_1", D, cfg.has_bias) + _linear(f"{h}.attn.c_attn", D, 2 * kv + D, cfg.has_bias)
            ps += _linear(f"{h}.attn.c_proj", D, D, cfg.has_bias) + _norm(f"{h}.ln_2", D, cfg.has_bias)
            ps += _linear(f"{h}.mlp.c_fc", D, F, cfg.has_bias) + _linear(f"{h}.mlp.c_proj", F, D, cfg.has_bias)
        ps += _norm("transformer.ln_f", D, cfg.has_bias)
        if not cfg.tied:
            ps += [ParamSpec("lm_head.weight", (V, D))]
    else:
        ps += [ParamSpec("model.embed_tokens.weight", (V, D))]
        for i in range(cfg.n_layer):
            h = f"model.layers.{i}"
            qkv_bias, mlp_bias = cfg.has_bias, cfg.has_mlp_bias
            ps += _linear(f"{h}.self_attn.q_proj", D, A, qkv_bias) + _linear(f"{h}.self_attn.k_proj", D, kv, qkv_bias)
            ps += _linear(f"{h}.self_attn.v_proj", D, kv, qkv_bias)
            ps += _linear(f"{h}.self_attn.o_proj", A, D, cfg.has_out_bias)
            if cfg.num_local_experts:  # HF Mixtral's sparse MoE block (models/moe.py)
                ps += moe_params(cfg, h)
            else:
                ps += _linear(f"{h}.mlp.gate_proj", D, F, mlp_bias) + _linear(f"{h}.mlp.up_proj", D, F, mlp_bias)
                ps += _linear(f"{h}.mlp.down_proj", F, D, mlp_bias)
            ps += [ParamSpec(f"{h}.input_layernorm.weight", (D,)),
                   ParamSpec(f"{h}.post_attention_layernorm.weight", (D,))]
        ps += [ParamSpec("model.norm.weight", (D,))]
        if not cfg.tied:
            ps += [ParamSpec("lm_head.weight", (V, D))]
    return ps


def _linear(name: str, d_in: int, d_out: int, bias: bool) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (d_out, d_in))] + ([ParamSpec(f"{name}.bias", (d_out,))] if bias else [])


def _norm(name: str, d: int, bias: bool) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (d,))] + ([ParamSpec(f"{name}.bias", (d,))] if bias else [])


def transformer_tape(cfg: TransformerConfig, setup: TrainingSetup, cpu: bool = False,
                     torch_version: str = "2.6") -> Tape:
    """`cpu`: the device's autocast op lists are CPU's (see `_Writer.softmax_dtype`); `torch_version`: on a GPU,
    whose CUDA kernels nn.RMSNorm runs (`_Writer.rmsnorm`)."""
    chosen = lora.targets(cfg, setup) if setup.lora_r else ()
    if cfg.implementation == "hf":
        return hf_gpt2_tape(cfg, setup, cpu)
    B, T = setup.micro_batch, setup.seq_len
    tape = lora.lora_tape(cfg, setup, transformer_params(cfg)) if chosen else Tape(params=transformer_params(cfg))
    w = _Writer(tape, setup, cpu)
    w.lora_targets = chosen
    w.fused_rms_norm = not cpu and gpu.cuda_fused_rms_norm(torch_version)
    idx = TensorSpec("batch.idx", (B, T), "int64", False)
    targets = TensorSpec("batch.targets", (B, T), "int64", False)
    tape.inputs = [idx, targets]
    gpt2 = cfg.family == "gpt2"
    tape.buffers = _buffers(cfg)
    wte = "transformer.wte" if gpt2 else "model.embed_tokens"
    emb_dt = w.fp32_op_dtype() if setup.precision.endswith("-autocast") else setup.param_dtype
    (x,) = w.op(wte, "embedding", [idx], [w.t(f"{wte}.out", (B, T, cfg.d_model), emb_dt)],
                saves=(idx.name,), params=(f"{wte}.weight",))
    if gpt2:
        (pos,) = w.op("transformer.pos", "arange", [], [w.t("transformer.pos", (T,), "int64", False)])
        (pe,) = w.op("transformer.wpe", "embedding", [pos], [w.t("transformer.wpe.out", (T, cfg.d_model), emb_dt)],
                     saves=(pos.name,), params=("transformer.wpe.weight",))
        x = w.add("transformer.emb_add", x, pe)
    else:
        hd = cfg.head_size
        rope = w.op("model.rotary_emb", "rotary_tables", [],
                    [w.t("model.rotary_emb.cos", (T, hd), requires_grad=False),
                     w.t("model.rotary_emb.sin", (T, hd), requires_grad=False)],
                    workspace=(w.t("model.rotary_emb.freqs", (T, hd), "fp32", False),))
    x = w.dropout("transformer.drop", x, cfg.dropout)
    for segment in checkpoint_segments(setup, cfg.n_layer):
        for i in segment.layers:
            w.begin_layer(segment, i)
            h = f"transformer.h.{i}" if gpt2 else f"model.layers.{i}"
            block_input = x
            x = _gpt2_block(w, cfg, h, x) if gpt2 else _llama_block(w, cfg, h, x, rope)
            if _input_outlives_its_uses(segment, i):
                w.op(f"{h}.return", "release", [block_input], [])
    w.end_layers()
    x = w.layernorm("transformer.ln_f", x, cfg.has_bias) if gpt2 else w.rmsnorm("model.norm", x)
    head_weight = f"{wte}.weight" if cfg.tied else "lm_head.weight"
    logits = w.linear("lm_head", x, cfg.vocab_size, False, weight=head_weight)
    _cross_entropy(w, logits, targets)
    if w.autocast or w.lora_targets:  # the final norm's output is a local of GPT.forward until it returns (the
        w.op("model.return", "release", [x], [])  # head saves a cast of it, or nothing: a frozen head under LoRA)
    tape.held = (logits.name,) if setup.logits_held else ()
    if chosen:
        lora.lazy_recompute(tape)
    return tape


def _input_outlives_its_uses(segment: Segment, layer: int) -> bool:
    """The caller's loop variable holds a block's input until the block returns (`x = block(x)`). That
    outlives the block's own last read of it only where nothing else keeps it: inside a checkpointed
    segment of several layers (its first layer's input is the segment's input, held anyway) and in an
    offloaded layer (the saved copy is on the host). Elsewhere it is saved for backward regardless."""
    return (segment.wrap == "checkpoint" and layer != segment.layers.start) or segment.wrap == "offload"


def _cross_entropy(w: _Writer, logits: TensorSpec, targets: TensorSpec) -> None:
    if w.autocast and not w.cpu:
        # CUDA autocast: F.cross_entropy is aten/src/ATen/native/LossNLL.cpp cross_entropy_loss, which calls
        # log_softmax(logits, dim, logits.dtype): an explicit dtype, which autocast's fp32_set_opt_dtype policy
        # leaves (autocast_mode.cpp), so it runs in 16-bit; then nll_loss, on autocast's CUDA fp32 list, reads an
        # fp32 copy of it, which it saves with the target and total_weight (derivatives.yaml nll_loss_forward)
        B, T, V = logits.shape
        (lsm,) = w.op("loss.log_softmax", "log_softmax", [logits],
                      [w.t("loss.log_softmax.out", logits.shape, logits.dtype)], saves=("loss.log_softmax.out",),
                      flops=5 * B * T * V)
        (lsm32,) = w.op("loss.autocast_input", "to_copy", [lsm], [w.t("loss.log_softmax_fp32", logits.shape, "fp32")])
        w.op("loss.nll", "nll_loss", [lsm32, targets],
             [w.t("loss", (), "fp32"), w.t("loss.total_weight", (), "fp32", False)],
             saves=(lsm32.name, targets.name, "loss.total_weight"))
        return
    lsm_dtype = "fp32" if w.autocast else logits.dtype
    if lsm_dtype != logits.dtype:  # autocast runs the loss in fp32: a temporary fp32 copy of the logits
        (logits,) = w.op("loss.autocast_input", "to_copy", [logits],
                         [w.t("loss.logits_fp32", logits.shape, lsm_dtype)])
    (lsm,) = w.op("loss.log_softmax", "log_softmax", [logits],
                  [w.t("loss.log_softmax.out", logits.shape, lsm_dtype)], saves=("loss.log_softmax.out",),
                  flops=5 * logits.shape[0] * logits.shape[1] * logits.shape[2])
    w.op("loss.nll", "nll_loss", [lsm, targets],
         [w.t("loss", (), lsm_dtype), w.t("loss.total_weight", (), lsm_dtype, False)],
         saves=(targets.name, "loss.total_weight"))


def _attention_eager(w: _Writer, prefix: str, q_src: TensorSpec, k_src: TensorSpec, v_src: TensorSpec,
                     n_head: int, n_kv: int, head_dim: int, dropout: float, fp32_softmax: bool = False) -> TensorSpec:
    B, T = q_src.shape[0], q_src.shape[1]
    D = n_head * head_dim
    with w.attention_core():
        y = _attention_eager_core(w, prefix, q_src, k_src, v_src, n_head, head_dim, dropout, fp32_softmax)
    (merged,) = w.op(f"{prefix}.merge_heads", "clone", [y], [w.t(f"{prefix}.merged", (B, T, D))])
    return merged


def _attention_eager_core(w: _Writer, prefix: str, q_src: TensorSpec, k_src: TensorSpec, v_src: TensorSpec,
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


# What a GPU profile's tape is written for: build_tape passes only `cpu`, so one target stands for the GPU
# profiles (A100 sm80, H100/H200 sm90 choose the same SDPA kernels under torch 2.6's rules) and the torch of
# the real GPU snapshots.
GPU_TARGET = ((9, 0), "2.6")


def _cuda_sdpa_backend(q: TensorSpec, n_head: int, n_kv: int, head_dim: int, dropout: float) -> str:
    cc, version = GPU_TARGET
    T = q.shape[1]
    return gpu.sdpa_backend(q.dtype, head_dim, dropout, False, True, cc, version, seq_q=T, seq_k=T, n_head=n_head,
                            n_kv_head=n_kv, enable_gqa=n_kv != n_head)


def _attention_sdpa(w: _Writer, prefix: str, q: TensorSpec, k: TensorSpec, v: TensorSpec,
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


def _attention_sdpa_cuda(w: _Writer, prefix: str, q: TensorSpec, k: TensorSpec, v: TensorSpec, n_head: int,
                         n_kv: int, head_dim: int, dropout: float) -> TensorSpec:
    """`F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal=True, enable_gqa=...)` on CUDA: the kernel
    models/gpu.py picks, its outputs (named as the CPU op's: .sdpa.out, .sdpa.lse), the tensors its backward
    keeps and its temporaries. The math fallback is written as eager attention (see the module docstring)."""
    backend = _cuda_sdpa_backend(q, n_head, n_kv, head_dim, dropout)
    if backend == "math":
        return _attention_eager(w, prefix, q, k, v, n_head, n_kv, head_dim, dropout, fp32_softmax=True)
    B, T = q.shape[0], q.shape[1]
    kernel = gpu.sdpa_kernel(backend, B, n_head, T, T, head_dim, q.dtype, dropout, GPU_TARGET[1], n_kv_head=n_kv)
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


def _gpt2_block(w: _Writer, cfg: TransformerConfig, h: str, x: TensorSpec) -> TensorSpec:
    kv = cfg.kv_heads * cfg.head_size
    a = w.layernorm(f"{h}.ln_1", x, cfg.has_bias)
    qkv = w.linear(f"{h}.attn.c_attn", a, cfg.d_model + 2 * kv, cfg.has_bias)
    if cfg.attention == "eager":
        y = _attention_eager(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.dropout)
    else:
        y = _attention_sdpa(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.head_size, cfg.kv_heads, cfg.dropout)
    y = w.linear(f"{h}.attn.c_proj", y, cfg.d_model, cfg.has_bias)
    y = w.dropout(f"{h}.attn.resid_dropout", y, cfg.dropout)
    # nanoGPT's `q, k, v = self.c_attn(x).split(...)`: the views keep the projection until the attention returns
    # (an SDPA kernel saves them anyway, and must stay their only reader: one gradient piece per view)
    _module_return(w, f"{h}.attn", a, *([qkv] if cfg.attention == "eager" else []))
    x = w.add(f"{h}.attn_residual", x, y)
    n = w.layernorm(f"{h}.ln_2", x, cfg.has_bias)
    m = w.linear(f"{h}.mlp.c_fc", n, cfg.ffn, cfg.has_bias)
    m = w.pointwise(f"{h}.mlp.gelu", "gelu", m)
    m = w.linear(f"{h}.mlp.c_proj", m, cfg.d_model, cfg.has_bias)
    m = w.dropout(f"{h}.mlp.dropout", m, cfg.dropout)
    _module_return(w, f"{h}.mlp", n)
    return w.add(f"{h}.mlp_residual", x, m)


def _module_return(w: _Writer, module: str, x: TensorSpec, *locals_: TensorSpec) -> None:
    """A module's `forward(x)` argument and its locals stay referenced by its Python frame until it returns. That
    outlives their last use where nothing saves them: the input under LoRA (models/lora.py `module_return`) and,
    on a GPU, under autocast (the linears save their 16-bit casts, aten/src/ATen/autocast_mode.cpp, not the fp32
    input), and the `locals_` the caller names (on a GPU; CPU tapes are kept as validated)."""
    held = ([x] if w.lora_targets or (w.autocast and not w.cpu) else []) + ([] if w.cpu else list(locals_))
    if held:
        w.op(f"{module}.return", "release", held, [])


def _buffers(cfg: TransformerConfig) -> list[TensorSpec]:
    """Registered module buffers: nanoGPT's causal mask per layer (eager attention only), Llama's
    rotary inv_freq. Both are floating point, created fp32; the engine stores them in the parameters'
    dtype, as `model.to(dtype)` casts them (Engine.load)."""
    if cfg.family == "gpt2":
        if cfg.attention != "eager":
            return []
        L = cfg.max_seq_len
        return [TensorSpec(f"transformer.h.{i}.attn.bias", (1, 1, L, L), "fp32", False) for i in range(cfg.n_layer)]
    return [TensorSpec("model.rotary_emb.inv_freq", (cfg.head_size // 2,), "fp32", False)]


def _llama_block(w: _Writer, cfg: TransformerConfig, h: str, x: TensorSpec, rope) -> TensorSpec:
    """q_proj is n_head * head_size wide (`attn_dim`: not d_model when `head_dim` says so), k/v_proj
    n_kv_head * head_size; o_proj maps attn_dim back to d_model. Biases as `bias` (q/k/v), `out_bias`
    (o_proj) and `mlp_bias` say: a bias adds a parameter, nothing saved."""
    kv = cfg.kv_heads * cfg.head_size
    B, T = x.shape[0], x.shape[1]
    a = w.rmsnorm(f"{h}.input_layernorm", x)
    q = w.linear(f"{h}.self_attn.q_proj", a, cfg.attn_dim, cfg.has_bias)
    k = w.linear(f"{h}.self_attn.k_proj", a, kv, cfg.has_bias)
    v = w.linear(f"{h}.self_attn.v_proj", a, kv, cfg.has_bias)
    cos, sin = rope
    # q * cos + rotate_half(q) * sin, and the same for k: each product saves its table
    q_rot, k_rot = w.op(f"{h}.self_attn.rotary", "rotary", [q, k, cos, sin],
                        [w.t(f"{h}.self_attn.q_rot", q.shape), w.t(f"{h}.self_attn.k_rot", k.shape)],
                        saves=(cos.name, sin.name, cos.name, sin.name),
                        workspace=(w.t(f"{h}.self_attn.rotate_half", q.shape, requires_grad=False),),
                        bwd_workspace=(w.t(f"{h}.self_attn.rotate_half_grad", q.shape, requires_grad=False),),
                        flops=6 * B * T * (cfg.attn_dim + kv))
    if cfg.attention == "eager":
        y = _attention_eager(w, f"{h}.self_attn", q_rot, k_rot, v, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.dropout,
                             fp32_softmax=True)
    else:
        y = _attention_sdpa(w, f"{h}.self_attn", q_rot, k_rot, v, cfg.n_head, cfg.head_size, cfg.kv_heads, cfg.dropout)
    y = w.linear(f"{h}.self_attn.o_proj", y, cfg.d_model, cfg.has_out_bias)
    _module_return(w, f"{h}.self_attn", a)
    x = w.add(f"{h}.attn_residual", x, y)
    m = w.rmsnorm(f"{h}.post_attention_layernorm", x)
    gate = w.linear(f"{h}.mlp.gate_proj", m, cfg.ffn, cfg.has_mlp_bias)
    up = w.linear(f"{h}.mlp.up_proj", m, cfg.ffn, cfg.has_mlp_bias)
    act = w.pointwise(f"{h}.mlp.silu", "silu", gate)
    (prod_,) = w.op(f"{h}.mlp.mul", "mul", [act, up], [w.t(f"{h}.mlp.mul", act.shape)], saves=(act.name, up.name))
    down = w.linear(f"{h}.mlp.down_proj", prod_, cfg.d_model, cfg.has_mlp_bias)
    _module_return(w, f"{h}.mlp", m)
    return w.add(f"{h}.mlp_residual", x, down)


# -- HF transformers GPT-2 (implementation "hf") ---------------------------------------------------
#
# The same parameters as nanoGPT's GPT-2, run by transformers' GPT2LMHeadModel (5.x, use_cache=False).
# What differs is how it allocates, and every difference is written out below as torch runs it:
#
# - Conv1D is `addmm(bias, x, W)`. Under autocast all three arguments are cast, right to left (W, x,
#   bias); the casts of W and bias are parameters' casts, which autocast caches until it exits at the
#   end of the forward. They are explicit tensors here, so their 16-bit gradients and the ToCopy
#   nodes that turn them fp32 are explicit too.
# - Positions are `arange(T) + 0`; a packed-sequence check runs on them (small int64 temporaries).
# - Eager attention adds a float causal mask, (B, 1, T, T) in the embeddings' dtype, built once per
#   forward and alive until the transformer returns (or, checkpointed, until the last block's backward).
#   The mask add promotes a 16-bit score to fp32 under autocast, so softmax runs in fp32 and its
#   result is cast back to the value dtype. SDPA needs no mask (is_causal); with dropout on a CPU it
#   runs torch's composite math path, which upcasts 16-bit q, k, v to fp32.
# - Dropout on a CPU is `input * (empty_like(input).bernoulli_(1 - p) / (1 - p))`: the saved mask has
#   the input's dtype (CUDA's fused kernel saves a bool mask). p = 0 allocates nothing.
# - "gelu_new" is eight pointwise ops; four of their results are saved.
# - The loss upcasts the logits to fp32, pads the labels by one and copies the shifted slice.
# - Python locals keep tensors alive past their last use until their module returns: the attention's
#   q/k/v projection until the attention returns, the block's norm outputs, residual and branch
#   outputs (and the attention weights it discards) until the block returns, the embeddings until the
#   transformer returns. `release` ops place those ends.

class _HFWriter(_Writer):
    """`_Writer` plus what HF's GPT-2 does differently: Conv1D, scope ends, the autocast cache."""

    def __init__(self, tape: Tape, setup: TrainingSetup, cpu: bool = False) -> None:
        super().__init__(tape, setup, cpu)
        self.param_shapes = {p.name: p.shape for p in tape.params}
        self.autocast_cache: list[TensorSpec] = []  # parameter casts, freed when the autocast context exits

    def release(self, name: str, tensors) -> None:
        """A scope end: the Python references that kept `tensors` alive go here (no memory of its own)."""
        tensors = [t for t in tensors if t is not None]
        if tensors:
            self.op(name, "release", tensors, [])

    def cached_cast(self, param: str) -> TensorSpec:
        """Autocast's 16-bit copy of a parameter, kept in autocast's cache until the forward ends."""
        (copy,) = self.op(f"{param}.autocast_cast", "to_copy", [],
                          [self.t(f"{param}.autocast_copy", self.param_shapes[param])], params=(param,))
        self.autocast_cache.append(copy)
        return copy

    def addmm(self, name: str, x: TensorSpec, out_features: int, bias: bool = True,
              weight: str | None = None) -> TensorSpec:
        """Conv1D (`addmm(bias, x, W)`) or a bias-free nn.Linear: saves its input (and, under autocast,
        the weight copy it multiplies by)."""
        weight = weight or f"{name}.weight"
        out = self.t(f"{name}.out", (*x.shape[:-1], out_features))
        flops = 2 * x.shape[0] * x.shape[1] * x.shape[-1] * out_features
        if not self.autocast:
            params = (weight, f"{name}.bias") if bias else (weight,)
            (y,) = self.op(name, "linear", [x], [out], saves=(x.name,), params=params, flops=flops)
            return y
        w16 = self.cached_cast(weight)
        x16 = self.autocast_input(name, x)
        b16 = self.cached_cast(f"{name}.bias") if bias else None
        inputs = [x16, w16] + ([b16] if b16 else [])
        (y,) = self.op(name, "addmm", inputs, [out], saves=(x16.name, w16.name), flops=flops)
        return y


def hf_gpt2_tape(cfg: TransformerConfig, setup: TrainingSetup, cpu: bool = False) -> Tape:
    """`GPT2LMHeadModel.forward(input_ids=idx, labels=idx)` as torch runs it (see the notes above)."""
    if setup.checkpointing not in HF_CHECKPOINTING:
        raise ConfigError("checkpointing", f"implementation 'hf' is modelled with {' or '.join(HF_CHECKPOINTING)} "
                                           f"(HF's own switch), not {setup.checkpointing!r}")
    B, T, D = setup.micro_batch, setup.seq_len, cfg.d_model
    tape = Tape(params=transformer_params(cfg))
    w = _HFWriter(tape, setup, cpu)
    idx = TensorSpec("batch.idx", (B, T), "int64", False)
    targets = TensorSpec("batch.targets", (B, T), "int64", False)
    tape.inputs = [idx, targets]
    emb_dt = w.fp32_op_dtype() if w.autocast else setup.param_dtype
    (tokens,) = w.op("transformer.wte", "embedding", [idx], [w.t("transformer.wte.out", (B, T, D), emb_dt)],
                     saves=(idx.name,), params=("transformer.wte.weight",))
    pos = _hf_position_ids(w, T)
    (positions,) = w.op("transformer.wpe", "embedding", [pos], [w.t("transformer.wpe.out", (1, T, D), emb_dt)],
                        saves=(pos.name,), params=("transformer.wpe.weight",))
    x = w.add("transformer.emb_add", tokens, positions)
    _hf_packed_sequence_check(w, pos, B, T)
    mask = _hf_causal_mask(w, B, T, emb_dt) if cfg.attention == "eager" else None
    x = w.dropout("transformer.drop", x, cfg.dropout)
    for i in range(cfg.n_layer):
        w.region = i if setup.checkpointing == "full" else None
        x = _hf_gpt2_block(w, cfg, f"transformer.h.{i}", x, mask)
    w.region = None
    x = w.layernorm("transformer.ln_f", x, True)
    w.release("transformer.return", [tokens, positions, mask])
    head_weight = "transformer.wte.weight" if cfg.tied else "lm_head.weight"
    logits = w.addmm("lm_head", x, cfg.vocab_size, bias=False, weight=head_weight)
    _hf_causal_lm_loss(w, logits, idx)
    w.release("lm_head_model.return", [x])  # the last hidden state, a local of GPT2LMHeadModel.forward
    w.release("autocast.exit", w.autocast_cache)
    tape.held = (logits.name,) if setup.logits_held else ()
    return tape


HF_CHECKPOINTING = ("none", "full")


def _hf_position_ids(w: _HFWriter, T: int) -> TensorSpec:
    """`arange(T) + past_seen_tokens` (0 without a cache): the arange is a temporary, the sum is saved
    by the position embedding."""
    (pos,) = w.op("transformer.position_ids", "arange", [], [w.t("transformer.position_ids", (T,), "int64", False)],
                  workspace=(w.t("transformer.position_ids.arange", (T,), "int64", False),))
    return pos


def _hf_packed_sequence_check(w: _HFWriter, pos: TensorSpec, B: int, T: int) -> None:
    """`find_packed_sequence_indices`: the first-position offset (B, 1), diff of the positions (a (B, T+1)
    concatenation, then (B, T)), `!= 1` and its cumsum. Only temporaries; the workspace is the largest
    set alive at one moment."""
    name = "transformer.packed_sequence_check"
    first = w.t(f"{name}.first", (B, 1), "int64", False)
    diff = w.t(f"{name}.diff", (B, T), "int64", False)
    with_prepend = (first, w.t(f"{name}.prepended", (B, T + 1), "int64", False), diff)
    with_cumsum = (first, diff, w.t(f"{name}.ne", (B, T), "bool", False), w.t(f"{name}.cumsum", (B, T), "int64", False))
    workspace = max(with_prepend, with_cumsum, key=lambda ts: sum(t.nbytes for t in ts))
    w.op(name, "cumsum", [pos], [], workspace=workspace)


def _hf_causal_mask(w: _HFWriter, B: int, T: int, dtype: str) -> TensorSpec:
    """`eager_mask`: a bool (1, 1, T, T) `kv <= q` pattern turned by `torch.where` into 0 / dtype-min
    floats, expanded to (B, 1, T, T) and materialised in the embeddings' dtype."""
    name = "transformer.causal_mask"
    workspace = (w.t(f"{name}.pattern", (1, 1, T, T), "bool", False), w.t(f"{name}.zero", (), dtype, False),
                 w.t(f"{name}.min", (), "fp32", False))
    (mask,) = w.op(name, "where", [], [w.t(name, (B, 1, T, T), dtype, False)], workspace=workspace)
    return mask


def _hf_gpt2_block(w: _HFWriter, cfg: TransformerConfig, h: str, x: TensorSpec, mask: TensorSpec | None) -> TensorSpec:
    D, p = cfg.d_model, cfg.dropout
    a = w.layernorm(f"{h}.ln_1", x, True)
    qkv = w.addmm(f"{h}.attn.c_attn", a, 3 * D)
    sdpa_kernel = cfg.attention == "sdpa" and not _sdpa_runs_math(w, p, qkv, cfg)
    if cfg.attention == "eager":
        y, weights = _hf_eager_attention(w, cfg, f"{h}.attn", qkv, mask)
    elif sdpa_kernel:
        y, weights = _attention_sdpa(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.head_size, cfg.n_head, p), None
    else:
        y, weights = _hf_sdpa_math(w, cfg, f"{h}.attn", qkv), None
    y = w.addmm(f"{h}.attn.c_proj", y, D)
    y = w.dropout(f"{h}.attn.resid_dropout", y, p)
    # q, k, v are views of the projection held by the attention's locals until it returns; an SDPA kernel
    # saves them anyway, and must stay their only reader so that each view gets its own gradient
    w.release(f"{h}.attn.return", [] if sdpa_kernel else [qkv])
    h1 = w.add(f"{h}.attn_residual", y, x)
    w.release(f"{h}.ln_1.scope_end", [a])  # `hidden_states = attn_output + residual` drops ln_1's output
    m = w.layernorm(f"{h}.ln_2", h1, True)
    f = w.addmm(f"{h}.mlp.c_fc", m, cfg.ffn)
    f = _hf_activation(w, cfg.mlp_activation, f"{h}.mlp.act", f)
    y2 = w.addmm(f"{h}.mlp.c_proj", f, D)
    y2 = w.dropout(f"{h}.mlp.dropout", y2, p)
    out = w.add(f"{h}.mlp_residual", h1, y2)
    w.release(f"{h}.return", [m, y, y2, h1, weights])
    return out


def _sdpa_runs_math(w: _HFWriter, dropout: float, qkv: TensorSpec, cfg: TransformerConfig) -> bool:
    """On a CPU, SDPA with dropout falls back from the flash kernel to torch's composite math path; on CUDA,
    where no fused kernel takes the inputs (models/gpu.py `sdpa_backend`)."""
    if w.cpu:
        return dropout > 0
    return _cuda_sdpa_backend(qkv, cfg.n_head, cfg.n_head, cfg.head_size, dropout) == "math"


def _hf_eager_attention(w: _HFWriter, cfg: TransformerConfig, prefix: str, qkv: TensorSpec, mask: TensorSpec):
    """`eager_attention_forward`: (q @ k^T) * scale + mask, softmax, cast to v's dtype, dropout, @ v.
    Returns the head-merged output and the attention weights (the block holds them until it returns)."""
    B, T, H, hd = qkv.shape[0], qkv.shape[1], cfg.n_head, cfg.head_size
    # q, k, v are views of the projection's split: each view's backward gives a head-shaped gradient piece,
    # and SplitBackward concatenates them into the projection's gradient once all three are in
    q, k = w.op(f"{prefix}.qk", "matmul", [qkv, qkv],
                [w.t(f"{prefix}.q_contig", (B, H, T, hd)), w.t(f"{prefix}.k_contig", (B, H, hd, T))],
                saves=(f"{prefix}.q_contig", f"{prefix}.k_contig"), views=(qkv.name, qkv.name))
    (scores,) = w.op(f"{prefix}.scores", "bmm", [q, k], [w.t(f"{prefix}.scores", (B, H, T, T))],
                     flops=2 * B * H * T * T * hd)
    (scaled,) = w.op(f"{prefix}.scale", "mul", [scores], [w.t(f"{prefix}.scaled", (B, H, T, T))])
    masked_dtype = "fp32" if "fp32" in (scaled.dtype, mask.dtype) else scaled.dtype
    (masked,) = w.op(f"{prefix}.mask_add", "add", [scaled, mask],
                     [w.t(f"{prefix}.masked", (B, H, T, T), masked_dtype)], passthrough=True)
    (probs,) = w.op(f"{prefix}.softmax", "softmax", [masked], [w.t(f"{prefix}.softmax", (B, H, T, T), masked_dtype)],
                    saves=(f"{prefix}.softmax",), flops=5 * B * H * T * T)
    weights = probs
    if probs.dtype != w.act:  # `attn_weights.type(value.dtype)`
        (weights,) = w.op(f"{prefix}.to_value_dtype", "to_copy", [probs],
                          [w.t(f"{prefix}.weights", (B, H, T, T))])
    weights = w.dropout(f"{prefix}.attn_dropout", weights, cfg.dropout)
    (v,) = w.op(f"{prefix}.v_contig", "clone", [qkv], [w.t(f"{prefix}.v_contig", (B, H, T, hd))],
                views=(qkv.name,))
    (y,) = w.op(f"{prefix}.pv", "bmm", [weights, v], [w.t(f"{prefix}.pv", (B, H, T, hd))],
                saves=(weights.name, v.name), flops=2 * B * H * T * T * hd)
    (merged,) = w.op(f"{prefix}.merge_heads", "clone", [y], [w.t(f"{prefix}.merged", (B, T, H * hd))])
    return merged, weights


def _hf_sdpa_math(w: _HFWriter, cfg: TransformerConfig, prefix: str, qkv: TensorSpec) -> TensorSpec:
    """SDPA with dropout on a CPU: torch's composite math path (the flash kernel takes no dropout).

    16-bit q, k, v are upcast to fp32 first; q and k^T are each scaled by sqrt(scale) (new tensors),
    a (T, T) additive causal mask is built, then matmul, mask add (in place), `_safe_softmax`, dropout
    and @ v, as in eager; the output (and the attention weights, unused) are cast back. The scaled q,
    the mask and the fp32 copies live until the math function returns. (Under a TorchDispatchMode, such
    as the allocation tracker, torch takes the out-of-place branch of the mask add: the tracker shows
    one more (B, H, T, T) temporary than the profiler there.)
    """
    B, T, H, hd = qkv.shape[0], qkv.shape[1], cfg.n_head, cfg.head_size
    name = f"{prefix}.sdpa_math"
    upcast = qkv.dtype != "fp32"
    if upcast:  # three ToCopy nodes; their 16-bit gradients are modelled as the projection's one gradient
        q, k, v = w.op(f"{name}.upcast", "to_copy", [qkv],
                       [w.t(f"{name}.{n}_fp32", (B, H, T, hd), "fp32") for n in "qkv"])
    else:
        q = k = v = qkv
    (q_scaled,) = w.op(f"{name}.scale_q", "mul", [q], [w.t(f"{name}.q_scaled", (B, H, T, hd), "fp32")])
    workspace = (w.t(f"{name}.causal_pattern", (T, T), "bool", False), w.t(f"{name}.zero", (), "fp32", False),
                 w.t(f"{name}.min", (), "fp32", False))
    (mask,) = w.op(f"{name}.causal_mask", "where", [], [w.t(f"{name}.causal_mask", (T, T), "fp32", False)],
                   workspace=workspace)
    (k_scaled,) = w.op(f"{name}.scale_k", "mul", [k], [w.t(f"{name}.k_scaled", (B, H, hd, T), "fp32")])
    # matmul copies both operands contiguous (the copies are saved; a copy hands its gradient straight
    # back) and multiplies; the scaled k^T is a temporary of that one expression
    (qc,) = w.op(f"{name}.q_contig", "clone", [q_scaled], [w.t(f"{name}.q_contig", (B, H, T, hd), "fp32")],
                 passthrough=True)
    # the mask is added to the scores in place
    kc, scores = w.op(f"{name}.scores", "bmm", [qc, k_scaled, mask],
                      [w.t(f"{name}.k_contig", (B, H, hd, T), "fp32"), w.t(f"{name}.scores", (B, H, T, T), "fp32")],
                      saves=(qc.name, f"{name}.k_contig"), flops=2 * B * H * T * T * hd)
    (probs,) = w.op(f"{name}.softmax", "softmax", [scores], [w.t(f"{name}.softmax", (B, H, T, T), "fp32")],
                    saves=(f"{name}.softmax",), flops=5 * B * H * T * T)
    probs = w.dropout(f"{name}.dropout", probs, cfg.dropout)
    weights = None
    if upcast:
        (weights,) = w.op(f"{name}.weights_cast", "to_copy", [probs], [w.t(f"{name}.weights", (B, H, T, T))])
    (vc,) = w.op(f"{name}.v_contig", "clone", [v], [w.t(f"{name}.v_contig", (B, H, T, hd), "fp32")],
                 passthrough=True)
    (y,) = w.op(f"{name}.pv", "bmm", [probs, vc], [w.t(f"{name}.pv", (B, H, T, hd), "fp32")],
                saves=(probs.name, vc.name), flops=2 * B * H * T * T * hd)
    if upcast:
        (y,) = w.op(f"{name}.downcast", "to_copy", [y], [w.t(f"{name}.out", (B, H, T, hd))])
    w.release(f"{name}.return", [q_scaled, mask, weights] + ([q, k, v] if upcast else []))
    (merged,) = w.op(f"{prefix}.merge_heads", "clone", [y], [w.t(f"{prefix}.merged", (B, T, H * hd))])
    return merged


def _hf_activation(w: _HFWriter, activation: str, name: str, x: TensorSpec) -> TensorSpec:
    """"gelu" and "gelu_pytorch_tanh" are one fused kernel that saves its input. "gelu_new" is
    `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))`, op by op: pow saves x, tanh its
    result, the last product both factors; the rest are temporaries, and x stays alive (a local) until
    the activation returns."""
    if activation != "gelu_new":
        return w.pointwise(name, "gelu", x)
    shape = x.shape
    t = lambda suffix, rg=True: w.t(f"{name}.{suffix}", shape, x.dtype, rg)  # noqa: E731
    (half,) = w.op(f"{name}.half_x", "mul", [x], [t("half_x")])
    (cube,) = w.op(f"{name}.cube", "pow", [x], [t("cube")], saves=(x.name,),
                   bwd_workspace=(t("cube.grad_x_squared", False), t("cube.grad_3x_squared", False)))
    (scaled_cube,) = w.op(f"{name}.scale_cube", "mul", [cube], [t("scaled_cube")])
    (inner,) = w.op(f"{name}.inner", "add", [x, scaled_cube], [t("inner")], passthrough=True)
    (scaled,) = w.op(f"{name}.scale_inner", "mul", [inner], [t("scaled_inner")])
    (tanh,) = w.op(f"{name}.tanh", "tanh", [scaled], [t("tanh")], saves=(f"{name}.tanh",))
    (one_plus,) = w.op(f"{name}.one_plus", "add", [tanh], [t("one_plus")], passthrough=True)
    (y,) = w.op(f"{name}.out", "mul", [half, one_plus], [t("out")], saves=(half.name, one_plus.name))
    w.release(f"{name}.return", [x])
    return y


def _hf_causal_lm_loss(w: _HFWriter, logits: TensorSpec, labels: TensorSpec) -> None:
    """`ForCausalLMLoss`: `logits.float()` (a copy unless fp32 already), labels padded by one ignore
    index and the shifted slice copied contiguous (saved by the loss), cross-entropy (log_softmax saved).
    The fp32 logits and the padded labels are locals until the loss returns."""
    B, T, V = logits.shape
    logits32 = logits
    if logits.dtype != "fp32":
        (logits32,) = w.op("loss.logits_float", "to_copy", [logits], [w.t("loss.logits_fp32", logits.shape, "fp32")])
    (padded,) = w.op("loss.pad_labels", "constant_pad_nd", [labels],
                     [w.t("loss.padded_labels", (B, T + 1), "int64", False)])
    (shifted,) = w.op("loss.shift_labels", "clone", [padded], [w.t("loss.shift_labels", (B, T), "int64", False)])
    (lsm,) = w.op("loss.log_softmax", "log_softmax", [logits32], [w.t("loss.log_softmax.out", logits.shape, "fp32")],
                  saves=("loss.log_softmax.out",), flops=5 * B * T * V)
    w.op("loss.nll", "nll_loss", [lsm, shifted], [w.t("loss", (), "fp32"), w.t("loss.total_weight", (), "fp32", False)],
         saves=(shifted.name, "loss.total_weight"))
    w.release("loss.return", [logits32 if logits32 is not logits else None, padded])


def mlp_params(cfg: MLPConfig) -> list[ParamSpec]:
    dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
    ps: list[ParamSpec] = []
    for i in range(len(dims) - 1):
        ps += _linear(f"layers.{2 * i}", dims[i], dims[i + 1], cfg.bias)
    return ps


def mlp_tape(cfg: MLPConfig, setup: TrainingSetup, cpu: bool = False) -> Tape:
    """nn.Sequential(Linear, act, Linear, act, ..., Linear) on (micro_batch, d_in); F.mse_loss, a
    fused kernel that keeps its input and target for backward."""
    if setup.lora_r:
        lora.targets(cfg, setup)  # refused: LoRA is modelled on transformers
    B = setup.micro_batch
    tape = Tape(params=mlp_params(cfg))
    w = _Writer(tape, setup, cpu)
    x = TensorSpec("batch.x", (B, 1, cfg.d_in), setup.compute_dtype if not w.autocast else "fp32", False)
    y_true = TensorSpec("batch.y", (B, 1, cfg.d_out), x.dtype, False)
    tape.inputs = [x, y_true]
    dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
    h = x
    segments = checkpoint_segments(setup, len(dims) - 1)  # a layer: one Linear and the activation after it
    if any(seg.wrap == "selective" for seg in segments):
        raise ConfigError("checkpointing", "'selective' recomputes the attention core: an MLP has none; allowed for "
                                           "MLPs: none, full, every-k, sqrt, op-policy, offload, layers")
    for segment in segments:
        for i in segment.layers:
            w.begin_layer(segment, i)
            h = w.linear(f"layers.{2 * i}", h, dims[i + 1], cfg.bias)
            if i < len(dims) - 2:
                h = w.pointwise(f"layers.{2 * i + 1}", cfg.activation, h)
    w.end_layers()
    w.op("loss.mse", "mse_loss", [h, y_true], [w.t("loss", (), h.dtype)], saves=(h.name, y_true.name),
         workspace=(w.t("loss.mse.diff", h.shape, h.dtype, False),))
    tape.held = (h.name,) if setup.logits_held else ()
    return tape
