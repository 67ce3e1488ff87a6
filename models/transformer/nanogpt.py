"""The nanoGPT (GPT-2) and Llama tapes: embeddings, blocks, final norm, head and cross-entropy, written layer by
layer under the setup's checkpointing (`transformer_tape`, the nanogpt family's describer; HF's GPT-2 is hf_gpt2.py).
"""

from __future__ import annotations

from .. import gpu, lora
from ..config import TrainingSetup, TransformerConfig
from ..tape import Segment, Tape, TensorSpec, checkpoint_segments
from .attention import attention_eager, attention_sdpa
from .chunked_loss import chunked_cross_entropy
from .params import transformer_params
from .writer import TapeWriter, module_return


def transformer_tape(cfg: TransformerConfig, setup: TrainingSetup, cpu: bool = False,
                     torch_version: str = "2.6") -> Tape:
    """`cpu`: the device's autocast op lists are CPU's (see `TapeWriter.softmax_dtype`); `torch_version`: on a GPU,
    whose CUDA kernels nn.RMSNorm runs (`TapeWriter.rmsnorm`)."""
    chosen = lora.targets(cfg, setup) if setup.lora.r else ()
    B, T = setup.batch.micro_batch, setup.batch.seq_len
    tape = lora.lora_tape(cfg, setup, transformer_params(cfg)) if chosen else Tape(params=transformer_params(cfg))
    w = TapeWriter(tape, setup, cpu)
    w.lora_targets = chosen
    w.fused_rms_norm = not cpu and gpu.cuda_fused_rms_norm(torch_version)
    w.torch_version = torch_version
    # torchtune's recipes run `with OffloadActivations(): logits = model(batch)`, the output head under NoOpManager
    # (torchtune/training/_activation_offloading.py get_act_offloading_ctx_manager, 0.6.1) and the loss outside
    streams = setup.checkpointing.activation_offload == "streams"
    w.streams = streams
    idx = TensorSpec("batch.idx", (B, T), "int64", False)
    targets = TensorSpec("batch.targets", (B, T), "int64", False)
    tape.inputs = [idx, targets]
    gpt2 = cfg.architecture == "gpt2"
    tape.buffers = _buffers(cfg)
    wte = "transformer.wte" if gpt2 else "model.embed_tokens"
    emb_dt = w.fp32_op_dtype() if setup.precision.autocast else setup.precision.param
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
            if _input_outlives_its_uses(segment, i) or streams:
                w.op(f"{h}.return", "release", [block_input], [])
    w.end_layers()
    x = w.layernorm("transformer.ln_f", x, cfg.has_bias) if gpt2 else w.rmsnorm("model.norm", x)
    head_weight = f"{wte}.weight" if cfg.tied else "lm_head.weight"
    w.streams = False
    if setup.loop.chunked_loss:  # torchtune's chunked output + CEWithChunkedOutputLoss (chunked_loss.py)
        held = chunked_cross_entropy(w, x, targets, setup.loop.chunked_loss, head_weight, cfg.vocab_size)
    else:
        logits = w.linear("lm_head", x, cfg.vocab_size, False, weight=head_weight)
        _cross_entropy(w, logits, targets)
        held = (logits.name,)
    if w.autocast or w.lora_targets:  # the final norm's output is a local of GPT.forward until it returns (the
        w.op("model.return", "release", [x], [])  # head saves a cast of it, or nothing: a frozen head under LoRA)
    tape.held = held if setup.loop.holds_outputs else ()
    if chosen:
        lora.lazy_recompute(tape)
    return tape


def _input_outlives_its_uses(segment: Segment, layer: int) -> bool:
    """The caller's loop variable holds a block's input until the block returns (`x = block(x)`). That
    outlives the block's own last read of it only where nothing else keeps it: inside a checkpointed
    segment of several layers (its first layer's input is the segment's input, held anyway) and in an
    offloaded layer (the saved copy is on the host). Elsewhere it is saved for backward regardless."""
    return (segment.wrap == "checkpoint" and layer != segment.layers.start) or segment.wrap == "offload"


def _cross_entropy(w: TapeWriter, logits: TensorSpec, targets: TensorSpec) -> None:
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


def _gpt2_block(w: TapeWriter, cfg: TransformerConfig, h: str, x: TensorSpec) -> TensorSpec:
    kv = cfg.kv_heads * cfg.head_size
    a = w.layernorm(f"{h}.ln_1", x, cfg.has_bias)
    qkv = w.linear(f"{h}.attn.c_attn", a, cfg.d_model + 2 * kv, cfg.has_bias)
    if cfg.attention == "eager":
        y = attention_eager(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.dropout)
    else:
        y = attention_sdpa(w, f"{h}.attn", qkv, qkv, qkv, cfg.n_head, cfg.head_size, cfg.kv_heads, cfg.dropout)
    y = w.linear(f"{h}.attn.c_proj", y, cfg.d_model, cfg.has_bias)
    y = w.dropout(f"{h}.attn.resid_dropout", y, cfg.dropout)
    # nanoGPT's `q, k, v = self.c_attn(x).split(...)`: the views keep the projection until the attention returns
    # (an SDPA kernel saves them anyway, and must stay their only reader: one gradient piece per view)
    module_return(w, f"{h}.attn", a, *([qkv] if cfg.attention == "eager" else []))
    x = w.add(f"{h}.attn_residual", x, y)
    n = w.layernorm(f"{h}.ln_2", x, cfg.has_bias)
    m = w.linear(f"{h}.mlp.c_fc", n, cfg.ffn, cfg.has_bias)
    m = w.pointwise(f"{h}.mlp.gelu", "gelu", m)
    m = w.linear(f"{h}.mlp.c_proj", m, cfg.d_model, cfg.has_bias)
    m = w.dropout(f"{h}.mlp.dropout", m, cfg.dropout)
    module_return(w, f"{h}.mlp", n)
    return w.add(f"{h}.mlp_residual", x, m)


def _buffers(cfg: TransformerConfig) -> list[TensorSpec]:
    """Registered module buffers: nanoGPT's causal mask per layer (eager attention only), Llama's
    rotary inv_freq. Both are floating point, created fp32; the engine stores them in the parameters'
    dtype, as `model.to(dtype)` casts them (Engine.load)."""
    if cfg.architecture == "gpt2":
        if cfg.attention != "eager":
            return []
        L = cfg.max_seq_len
        return [TensorSpec(f"transformer.h.{i}.attn.bias", (1, 1, L, L), "fp32", False) for i in range(cfg.n_layer)]
    return [TensorSpec("model.rotary_emb.inv_freq", (cfg.head_size // 2,), "fp32", False)]


def _llama_block(w: TapeWriter, cfg: TransformerConfig, h: str, x: TensorSpec, rope) -> TensorSpec:
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
        y = attention_eager(w, f"{h}.self_attn", q_rot, k_rot, v, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.dropout,
                             fp32_softmax=True)
    else:
        y = attention_sdpa(w, f"{h}.self_attn", q_rot, k_rot, v, cfg.n_head, cfg.head_size, cfg.kv_heads, cfg.dropout)
    y = w.linear(f"{h}.self_attn.o_proj", y, cfg.d_model, cfg.has_out_bias)
    module_return(w, f"{h}.self_attn", a)
    x = w.add(f"{h}.attn_residual", x, y)
    m = w.rmsnorm(f"{h}.post_attention_layernorm", x)
    gate = w.linear(f"{h}.mlp.gate_proj", m, cfg.ffn, cfg.has_mlp_bias)
    up = w.linear(f"{h}.mlp.up_proj", m, cfg.ffn, cfg.has_mlp_bias)
    act = w.pointwise(f"{h}.mlp.silu", "silu", gate)
    (prod_,) = w.op(f"{h}.mlp.mul", "mul", [act, up], [w.t(f"{h}.mlp.mul", act.shape)], saves=(act.name, up.name))
    down = w.linear(f"{h}.mlp.down_proj", prod_, cfg.d_model, cfg.has_mlp_bias)
    module_return(w, f"{h}.mlp", m)
    return w.add(f"{h}.mlp_residual", x, down)
