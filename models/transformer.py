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
  of the projection), its output and the logsumexp (B*heads*T, fp32) only.
- Cross-entropy: log_softmax output (B*T*vocab, fp32 under autocast) is saved; the caller holds the
  logits until backward ends (`TrainingSetup.logits_held`).

Under torch.autocast, linears and matmuls run in 16-bit: their weights are cast (the cast copy is
saved for backward, and its 16-bit gradient is turned fp32 by a separate node), and an fp32 input is
cast to a new 16-bit tensor that the linear saves instead of the fp32 input. Embeddings, norms and the
loss produce fp32 (the loss reads a temporary fp32 copy of the 16-bit logits); softmax is fp32 under
CUDA autocast but keeps its 16-bit input dtype under CPU autocast (`describe(..., "cpu")`). A residual
add of fp32 and 16-bit tensors is fp32, and its backward casts the gradient for the 16-bit input.
"""

from __future__ import annotations

from .config import MLPConfig, TrainingSetup, TransformerConfig
from .tape import ParamSpec, Tape, TensorSpec


class _Writer:
    """Small helper that knows B, T and the dtypes, so the block code reads like the model."""

    def __init__(self, tape: Tape, setup: TrainingSetup, cpu: bool = False) -> None:
        self.tape = tape
        self.setup = setup
        self.cpu = cpu
        self.autocast = setup.precision.endswith("-autocast")
        self.act = setup.compute_dtype
        self.region: int | None = None

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
        return self.tape.add(name, kind, [i.name if isinstance(i, TensorSpec) else i for i in inputs],
                             outputs, **kw)

    def linear(self, name: str, x: TensorSpec, out_features: int, bias: bool, weight: str | None = None):
        weight = weight or f"{name}.weight"
        params = (weight, f"{name}.bias") if bias else (weight,)
        in_features = x.shape[-1]
        rows = x.shape[0] * x.shape[1]
        x = self.autocast_input(name, x)
        (y,) = self.op(name, "linear", [x], [self.t(f"{name}.out", (*x.shape[:-1], out_features))],
                       saves=(x.name,), params=params, casts=(weight,) if self.autocast else (),
                       flops=2 * rows * in_features * out_features)
        return y

    def layernorm(self, name: str, x: TensorSpec, bias: bool):
        B, T, D = x.shape
        dt = self.fp32_op_dtype()
        y, mean, rstd = self.op(name, "layernorm", [x],
                                [self.t(f"{name}.out", x.shape, dt), self.t(f"{name}.mean", (B, T, 1), "fp32", False),
                                 self.t(f"{name}.rstd", (B, T, 1), "fp32", False)],
                                saves=(x.name, f"{name}.mean", f"{name}.rstd"),
                                params=(f"{name}.weight", f"{name}.bias") if bias else (f"{name}.weight",),
                                flops=8 * B * T * D)
        return y

    def rmsnorm(self, name: str, x: TensorSpec):
        """torch's composite RMSNorm (nn.RMSNorm on CPU, HF's LlamaRMSNorm): x * rsqrt(mean(x^2) + eps)
        keeps x and rstd for its backward, and the normalised x for the multiply by the weight."""
        B, T, D = x.shape
        dt = self.fp32_op_dtype()
        y, rstd, normed = self.op(name, "rmsnorm", [x], [self.t(f"{name}.out", x.shape, dt),
                                                         self.t(f"{name}.rstd", (B, T, 1), "fp32", False),
                                                         self.t(f"{name}.normed", x.shape, dt, False)],
                                  saves=(x.name, f"{name}.rstd", f"{name}.normed"), params=(f"{name}.weight",),
                                  flops=6 * B * T * D)
        return y

    def dropout(self, name: str, x: TensorSpec, p: float):
        if p <= 0:
            return x
        y, mask = self.op(name, "dropout", [x], [self.t(f"{name}.out", x.shape, x.dtype),
                                                 self.t(f"{name}.mask", x.shape, "bool", False)],
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
    kv = cfg.kv_heads * cfg.head_dim
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
            ps += _linear(f"{h}.self_attn.q_proj", D, D, cfg.has_bias) + _linear(f"{h}.self_attn.k_proj", D, kv, cfg.has_bias)
            ps += _linear(f"{h}.self_attn.v_proj", D, kv, cfg.has_bias) + _linear(f"{h}.self_attn.o_proj", D, D, False)
            ps += _linear(f"{h}.mlp.gate_proj", D, F, False) + _linear(f"{h}.mlp.up_proj", D, F, False)
            ps += _linear(f"{h}.mlp.down_proj", F, D, False)
            ps += [ParamSpec(f"{h}.input_layernorm.weight", (D,)), ParamSpec(f"{h}.post_attention_layernorm.weight", (D,))]
        ps += [ParamSpec("model.norm.weight", (D,))]
        if not cfg.tied:
            ps += [ParamSpec("lm_head.weight", (V, D))]
    return ps


def _linear(name: str, d_in: int, d_out: int, bias: bool) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (d_out, d_in))] + ([ParamSpec(f"{name}.bias", (d_out,))] if bias else [])


def _norm(name: str, d: int, bias: bool) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (d,))] + ([ParamSpec(f"{name}.bias", (d,))] if bias else [])


def transformer_tape(cfg: TransformerConfig, setup: TrainingSetup, cpu: bool = False) -> Tape:
    """`cpu`: the device's autocast op lists are CPU's (see `_Writer.softmax_dtype`)."""
    B, T = setup.micro_batch, setup.seq_len
    tape = Tape(params=transformer_params(cfg))
    w = _Writer(tape, setup, cpu)
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
        hd = cfg.head_dim
        rope = w.op("model.rotary_emb", "rotary_tables", [],
                    [w.t("model.rotary_emb.cos", (T, hd), requires_grad=False),
                     w.t("model.rotary_emb.sin", (T, hd), requires_grad=False)],
                    workspace=(w.t("model.rotary_emb.freqs", (T, hd), "fp32", False),))
    x = w.dropout("transformer.drop", x, cfg.dropout)
    for i in range(cfg.n_layer):
        w.region = i if setup.checkpointing == "full" else None
        x = _gpt2_block(w, cfg, f"transformer.h.{i}", x) if gpt2 else _llama_block(w, cfg, f"model.layers.{i}", x, rope)
    w.region = None
    x = w.layernorm("transformer.ln_f", x, cfg.has_bias) if gpt2 else w.rmsnorm("model.norm", x)
    head_weight = f"{wte}.weight" if cfg.tied else "lm_head.weight"
    logits = w.linear("lm_head", x, cfg.vocab_size, False, weight=head_weight)
    _cross_entropy(w, logits, targets)
    tape.held = (logits.name,) if setup.logits_held else ()
    return tape


def _cross_entropy(w: _Writer, logits: TensorSpec, targets: TensorSpec) -> None:
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
                     n_head: int, n_kv: int, head_dim: int, dropout: float) -> TensorSpec:
    B, T = q_src.shape[0], q_src.shape[1]
    D = n_head * head_dim
    hd = head_dim
    q, k = w.op(f"{prefix}.qk", "matmul", [q_src, k_src],
                [w.t(f"{prefix}.q_contig", (B, n_head, T, hd)), w.t(f"{prefix}.k_contig", (B, n_head, hd, T))],
                saves=(f"{prefix}.q_contig", f"{prefix}.k_contig"))
    (scores,) = w.op(f"{prefix}.scores", "bmm", [q, k], [w.t(f"{prefix}.scores", (B, n_head, T, T))],
                     flops=2 * B * n_head * T * T * hd)
    (scaled,) = w.op(f"{prefix}.scale", "mul", [scores], [w.t(f"{prefix}.scaled", (B, n_head, T, T))])
    (mask,) = w.op(f"{prefix}.causal_mask", "eq", [], [w.t(f"{prefix}.causal_mask", (1, 1, T, T), "bool", False)])
    (masked,) = w.op(f"{prefix}.masked_fill", "masked_fill", [scaled, mask],
                     [w.t(f"{prefix}.masked", (B, n_head, T, T))], saves=(mask.name,))
    sm_dtype = w.softmax_dtype(masked)
    (probs,) = w.op(f"{prefix}.softmax", "softmax", [masked], [w.t(f"{prefix}.softmax", (B, n_head, T, T), sm_dtype)],
                    saves=(f"{prefix}.softmax",), flops=5 * B * n_head * T * T)
    probs = w.dropout(f"{prefix}.attn_dropout", probs, dropout)
    (v,) = w.op(f"{prefix}.v_contig", "clone", [v_src], [w.t(f"{prefix}.v_contig", (B, n_head, T, hd))])
    (y,) = w.op(f"{prefix}.pv", "bmm", [probs, v], [w.t(f"{prefix}.pv", (B, n_head, T, hd))],
                saves=(probs.name, v.name), flops=2 * B * n_head * T * T * hd)
    (merged,) = w.op(f"{prefix}.merge_heads", "clone", [y], [w.t(f"{prefix}.merged", (B, T, D))])
    return merged


def _attention_sdpa(w: _Writer, prefix: str, q: TensorSpec, k: TensorSpec, v: TensorSpec,
                    n_head: int, head_dim: int) -> TensorSpec:
    B, T = q.shape[0], q.shape[1]
    D = n_head * head_dim
    out, lse = w.op(f"{prefix}.sdpa", "sdpa", [q, k, v],
                    [w.t(f"{prefix}.sdpa.out", (B, T, D)), w.t(f"{prefix}.sdpa.lse", (B, n_head, T), "fp32", False)],
                    saves=(q.name, k.name, v.name, f"{prefix}.sdpa.out", f"{prefix}.sdpa.lse"),
                    flops=4 * B * n_head * T * T * head_dim)
    return out


def _gpt2_block(w: _Writer, cfg: TransformerConfig, h: str, x: TensorSpec) -> TensorSpec:
    kv = cfg.kv_heads * cfg.head_dim
    a = w.layernorm(f"{h}.ln_1", x, cfg.has_bias)
    qkv = w.linear(f"{h}.attn.c_attn", a, cfg.d_model + 2 * kv, cfg.has_bias)
    if cfg.attention == "eager":
        y = _attention_eager(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.dropout)
    else:
        y = _attention_sdpa(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.head_dim)
    y = w.linear(f"{h}.attn.c_proj", y, cfg.d_model, cfg.has_bias)
    y = w.dropout(f"{h}.attn.resid_dropout", y, cfg.dropout)
    x = w.add(f"{h}.attn_residual", x, y)
    m = w.layernorm(f"{h}.ln_2", x, cfg.has_bias)
    m = w.linear(f"{h}.mlp.c_fc", m, cfg.ffn, cfg.has_bias)
    m = w.pointwise(f"{h}.mlp.gelu", "gelu", m)
    m = w.linear(f"{h}.mlp.c_proj", m, cfg.d_model, cfg.has_bias)
    m = w.dropout(f"{h}.mlp.dropout", m, cfg.dropout)
    return w.add(f"{h}.mlp_residual", x, m)


def _buffers(cfg: TransformerConfig) -> list[TensorSpec]:
    """Registered module buffers: nanoGPT's causal mask per layer (eager attention only), Llama's
    rotary inv_freq."""
    if cfg.family == "gpt2":
        if cfg.attention != "eager":
            return []
        L = cfg.max_seq_len
        return [TensorSpec(f"transformer.h.{i}.attn.bias", (1, 1, L, L), "fp32", False) for i in range(cfg.n_layer)]
    return [TensorSpec("model.rotary_emb.inv_freq", (cfg.head_dim // 2,), "fp32", False)]


def _llama_block(w: _Writer, cfg: TransformerConfig, h: str, x: TensorSpec, rope) -> TensorSpec:
    kv = cfg.kv_heads * cfg.head_dim
    B, T = x.shape[0], x.shape[1]
    a = w.rmsnorm(f"{h}.input_layernorm", x)
    q = w.linear(f"{h}.self_attn.q_proj", a, cfg.d_model, cfg.has_bias)
    k = w.linear(f"{h}.self_attn.k_proj", a, kv, cfg.has_bias)
    v = w.linear(f"{h}.self_attn.v_proj", a, kv, cfg.has_bias)
    cos, sin = rope
    q_rot, k_rot = w.op(f"{h}.self_attn.rotary", "rotary", [q, k, cos, sin],
                        [w.t(f"{h}.self_attn.q_rot", q.shape), w.t(f"{h}.self_attn.k_rot", k.shape)],
                        saves=(cos.name, sin.name),
                        workspace=(w.t(f"{h}.self_attn.rotate_half", q.shape, requires_grad=False),),
                        bwd_workspace=(w.t(f"{h}.self_attn.rotate_half_grad", q.shape, requires_grad=False),),
                        flops=6 * B * T * (cfg.d_model + kv))
    if cfg.attention == "eager":
        y = _attention_eager(w, f"{h}.self_attn", q_rot, k_rot, v, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.dropout)
    else:
        y = _attention_sdpa(w, f"{h}.self_attn", q_rot, k_rot, v, cfg.n_head, cfg.head_dim)
    y = w.linear(f"{h}.self_attn.o_proj", y, cfg.d_model, False)
    x = w.add(f"{h}.attn_residual", x, y)
    m = w.rmsnorm(f"{h}.post_attention_layernorm", x)
    gate = w.linear(f"{h}.mlp.gate_proj", m, cfg.ffn, False)
    up = w.linear(f"{h}.mlp.up_proj", m, cfg.ffn, False)
    act = w.pointwise(f"{h}.mlp.silu", "silu", gate)
    (prod_,) = w.op(f"{h}.mlp.mul", "mul", [act, up], [w.t(f"{h}.mlp.mul", act.shape)], saves=(act.name, up.name))
    down = w.linear(f"{h}.mlp.down_proj", prod_, cfg.d_model, False)
    return w.add(f"{h}.mlp_residual", x, down)


def mlp_params(cfg: MLPConfig) -> list[ParamSpec]:
    dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
    ps: list[ParamSpec] = []
    for i in range(len(dims) - 1):
        ps += _linear(f"layers.{2 * i}", dims[i], dims[i + 1], cfg.bias)
    return ps


def mlp_tape(cfg: MLPConfig, setup: TrainingSetup, cpu: bool = False) -> Tape:
    """nn.Sequential(Linear, act, Linear, act, ..., Linear) on (micro_batch, d_in); F.mse_loss, a
    fused kernel that keeps its input and target for backward."""
    B = setup.micro_batch
    tape = Tape(params=mlp_params(cfg))
    w = _Writer(tape, setup, cpu)
    x = TensorSpec("batch.x", (B, 1, cfg.d_in), setup.compute_dtype if not w.autocast else "fp32", False)
    y_true = TensorSpec("batch.y", (B, 1, cfg.d_out), x.dtype, False)
    tape.inputs = [x, y_true]
    dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
    h = x
    for i in range(len(dims) - 1):
        w.region = i if setup.checkpointing == "full" else None
        h = w.linear(f"layers.{2 * i}", h, dims[i + 1], cfg.bias)
        if i < len(dims) - 2:
            h = w.pointwise(f"layers.{2 * i + 1}", cfg.activation, h)
    w.region = None
    w.op("loss.mse", "mse_loss", [h, y_true], [w.t("loss", (), h.dtype)], saves=(h.name, y_true.name),
         workspace=(w.t("loss.mse.diff", h.shape, h.dtype, False),))
    tape.held = (h.name,) if setup.logits_held else ()
    return tape
