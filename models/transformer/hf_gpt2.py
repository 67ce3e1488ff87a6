"""HF transformers' GPT2LMHeadModel as its code runs (`hf_gpt2_tape`): Conv1D, an additive float mask, CPU dropout
masks in the input's dtype, "gelu_new" op by op, HF's loss, and tensors Python locals keep until their module
returns (`HFWriter`).
"""

from __future__ import annotations

from ..config import ConfigError, TrainingSetup, TransformerConfig
from ..tape import Tape, TensorSpec
from .attention import attention_sdpa, cuda_sdpa_backend
from .params import transformer_params
from .writer import TapeWriter


class HFWriter(TapeWriter):
    """`TapeWriter` plus what HF's GPT-2 does differently: Conv1D, scope ends, the autocast cache."""

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
    if setup.checkpointing.policy not in HF_CHECKPOINTING:
        raise ConfigError("checkpointing", f"implementation 'hf' is modelled with {' or '.join(HF_CHECKPOINTING)} "
                                           f"(HF's own switch), not {setup.checkpointing.policy!r}")
    B, T, D = setup.batch.micro_batch, setup.batch.seq_len, cfg.d_model
    tape = Tape(params=transformer_params(cfg))
    w = HFWriter(tape, setup, cpu)
    idx = TensorSpec("batch.idx", (B, T), "int64", False)
    targets = TensorSpec("batch.targets", (B, T), "int64", False)
    tape.inputs = [idx, targets]
    emb_dt = w.fp32_op_dtype() if w.autocast else setup.precision.param
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
        w.region = i if setup.checkpointing.policy == "full" else None
        x = _hf_gpt2_block(w, cfg, f"transformer.h.{i}", x, mask)
    w.region = None
    x = w.layernorm("transformer.ln_f", x, True)
    w.release("transformer.return", [tokens, positions, mask])
    head_weight = "transformer.wte.weight" if cfg.tied else "lm_head.weight"
    logits = w.addmm("lm_head", x, cfg.vocab_size, bias=False, weight=head_weight)
    hf_causal_lm_loss(w, logits, idx)
    w.release("lm_head_model.return", [x])  # the last hidden state, a local of GPT2LMHeadModel.forward
    w.release("autocast.exit", w.autocast_cache)
    tape.held = (logits.name,) if setup.loop.holds_outputs else ()
    return tape


HF_CHECKPOINTING = ("none", "full")


def _hf_position_ids(w: HFWriter, T: int) -> TensorSpec:
    """`arange(T) + past_seen_tokens` (0 without a cache): the arange is a temporary, the sum is saved
    by the position embedding."""
    (pos,) = w.op("transformer.position_ids", "arange", [], [w.t("transformer.position_ids", (T,), "int64", False)],
                  workspace=(w.t("transformer.position_ids.arange", (T,), "int64", False),))
    return pos


def _hf_packed_sequence_check(w: HFWriter, pos: TensorSpec, B: int, T: int) -> None:
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


def _hf_causal_mask(w: HFWriter, B: int, T: int, dtype: str) -> TensorSpec:
    """`eager_mask`: a bool (1, 1, T, T) `kv <= q` pattern turned by `torch.where` into 0 / dtype-min
    floats, expanded to (B, 1, T, T) and materialised in the embeddings' dtype."""
    name = "transformer.causal_mask"
    workspace = (w.t(f"{name}.pattern", (1, 1, T, T), "bool", False), w.t(f"{name}.zero", (), dtype, False),
                 w.t(f"{name}.min", (), "fp32", False))
    (mask,) = w.op(name, "where", [], [w.t(name, (B, 1, T, T), dtype, False)], workspace=workspace)
    return mask


def _hf_gpt2_block(w: HFWriter, cfg: TransformerConfig, h: str, x: TensorSpec, mask: TensorSpec | None) -> TensorSpec:
    D, p = cfg.d_model, cfg.dropout
    a = w.layernorm(f"{h}.ln_1", x, True)
    qkv = w.addmm(f"{h}.attn.c_attn", a, 3 * D)
    sdpa_kernel = cfg.attention == "sdpa" and not _sdpa_runs_math(w, p, qkv, cfg)
    if cfg.attention == "eager":
        y, weights = _hf_eager_attention(w, cfg, f"{h}.attn", qkv, mask)
    elif sdpa_kernel:
        y, weights = attention_sdpa(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.head_size, cfg.n_head, p), None
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


def _sdpa_runs_math(w: HFWriter, dropout: float, qkv: TensorSpec, cfg: TransformerConfig) -> bool:
    """On a CPU, SDPA with dropout falls back from the flash kernel to torch's composite math path; on CUDA,
    where no fused kernel takes the inputs (models/gpu.py `sdpa_backend`)."""
    if w.cpu:
        return dropout > 0
    return cuda_sdpa_backend(qkv, cfg.n_head, cfg.n_head, cfg.head_size, dropout) == "math"


def _hf_eager_attention(w: HFWriter, cfg: TransformerConfig, prefix: str, qkv: TensorSpec, mask: TensorSpec):
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


def _hf_sdpa_math(w: HFWriter, cfg: TransformerConfig, prefix: str, qkv: TensorSpec) -> TensorSpec:
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


def _hf_activation(w: HFWriter, activation: str, name: str, x: TensorSpec) -> TensorSpec:
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


def hf_causal_lm_loss(w: HFWriter, logits: TensorSpec, labels: TensorSpec) -> None:
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
