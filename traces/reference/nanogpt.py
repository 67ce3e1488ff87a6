"""Plain-torch reference models, built from the same config objects the describers read.

They exist to measure: run a real CPU training step on them (see `traces/tracker/`) and compare the
bytes with what `models.training.describe` + `simulator.engine.simulate` predict. Weights are random
(nothing is downloaded); only shapes, dtypes and the order of ops matter for memory.

- `GPT(cfg)` for family "gpt2" is nanoGPT's model: parameter names and registration order are exactly
  `models.transformer.transformer_params(cfg)` (the tied `lm_head.weight` is `transformer.wte.weight`,
  and `named_parameters()` lists it once). `cfg.attention` picks nanoGPT's two paths:
  "sdpa" calls `F.scaled_dot_product_attention(..., is_causal=True)` and has no mask buffer;
  "eager" is nanoGPT's manual attention with its causal mask as a registered buffer `bias` of shape
  (1, 1, max_seq_len, max_seq_len), fp32, one per layer (nanoGPT registers it only when flash
  attention is unavailable, i.e. exactly on the eager path). We register it `persistent=False`: that
  keeps it out of `state_dict()` only; it is memory all the same (max_seq_len**2 * 4 bytes per layer),
  and the tracker labels it Category.BUFFER. The describer does not list this buffer.
- `GPT(cfg)` for family "llama" is a small Llama (HF names: `model.embed_tokens`,
  `model.layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, `input_layernorm`,
  `post_attention_layernorm`, `model.norm`, `lm_head`): `nn.RMSNorm`, rotary positions with HF's
  rotate_half formulation (cos/sin computed once per forward from a non-persistent `inv_freq` buffer),
  grouped-query attention (`enable_gqa` for SDPA, `repeat_interleave` of k/v for eager) and a SwiGLU
  MLP. The eager path builds its (T, T) bool causal mask on the fly, once per forward. Heads are
  `cfg.head_size` wide (HF's `head_dim`: q_proj's output and o_proj's input are n_head * head_size, not
  necessarily d_model); biases on q/k/v (`bias`), o_proj (`out_bias`) and gate/up/down (`mlp_bias`).
- `MLP(cfg)`: `layers` is an `nn.Sequential(Linear, act, Linear, act, ..., Linear)` so parameters are
  `layers.{2i}.weight/bias` as in `models.transformer.mlp_params`; the loss is `F.mse_loss` against a
  target (torch's fused MSE, not the describer's sub/pow/mean decomposition).

- `hf_gpt2(cfg)` for `cfg.implementation == "hf"` is HF transformers' own `GPT2LMHeadModel`, built from
  a `GPT2Config` with the same fields (random weights, nothing downloaded), behind nanoGPT's call
  signature (`HFGPT2Adapter`). Parameter names and order are `transformer_params(cfg)`'s; Conv1D keeps
  its weights as (in, out), the transpose of nn.Linear's, with the same bytes.

Every model's `forward(inputs, targets)` returns `(output, loss)` like nanoGPT (`loss` is None without
targets). Dropout is `nn.Dropout(cfg.dropout)` where nanoGPT has it; GELU is exact (`nn.GELU()`).

Activation checkpointing (`TrainingSetup.checkpointing`) runs the layers in the segments
`models.tape.checkpoint_segments` gives, each through `run_segment`, with torch's own mechanisms:
`torch.utils.checkpoint.checkpoint(use_reentrant=False)` for whole layers or segments of them,
the same around the attention core alone for "selective" (`attention_core`),
`create_selective_checkpoint_contexts` with `OP_POLICY` for "op-policy", and
`torch.autograd.graph.save_on_cpu(pin_memory=True)` for "offload". On a machine without CUDA,
save_on_cpu cannot pin: each saved tensor is copied into a new (CPU) tensor as it is saved, and handed
back as it is in backward (`.to("cpu")` of a CPU tensor is itself). The nanoGPT and Llama models and
the MLP run every policy ("selective" needs attention: not the MLP); HF's GPT2LMHeadModel runs "none"
and "full" only (its own switch).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from ...models.config import ConfigError, MLPConfig, TrainingSetup, TransformerConfig
from ...models.families.transformer import check_seq_len
from ...models.tape import Segment, checkpoint_segments, checkpointed, op_policy

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REFERENCE_PRECISIONS = ("fp32", "bf16", "bf16-autocast")


OP_POLICY = op_policy()  # selective activation checkpointing of "op-policy" (models/tape.py: one for both sides)
OP_POLICY_SAVES = OP_POLICY.saves


def run_segment(fn, wrap: str, x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for one `Segment` of layers, wrapped as its `wrap` says (see models/tape.py `Segment`)."""
    if not torch.is_grad_enabled() or wrap in ("none", "selective"):
        return fn(x)
    return checkpointed(fn, wrap)(x)


def _segments(setup: TrainingSetup | str | None, n_layer: int) -> tuple[Segment, ...]:
    """The checkpoint segments of a model with `n_layer` layers; a bare policy name takes the defaults."""
    if setup is None or isinstance(setup, str):
        setup = TrainingSetup(checkpointing=setup or "none")
    return checkpoint_segments(setup, n_layer)


def attention_core(fn, checkpointed: bool, *tensors: torch.Tensor) -> torch.Tensor:
    """The attention core (`fn(q, k, v, ...)`): its own non-reentrant checkpoint under "selective"."""
    if checkpointed and torch.is_grad_enabled():
        return _checkpoint(fn, *tensors, use_reentrant=False)
    return fn(*tensors)


def autocast_context(setup: TrainingSetup | None):
    """The context the forward pass and loss run under: torch.autocast("cpu", bf16) for "bf16-autocast"."""
    if setup is not None and setup.precision.autocast:
        return torch.autocast("cpu", dtype=TORCH_DTYPES[setup.precision.autocast])
    return contextlib.nullcontext()


# -- GPT-2 (nanoGPT) --------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_size
        self.d_model = cfg.d_model
        kv = self.n_kv * self.head_dim
        self.c_attn = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv, bias=cfg.has_bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.has_bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        self.flash = cfg.attention == "sdpa"
        self.checkpoint_core = False  # "selective": the core runs under its own checkpoint
        if not self.flash:
            L = cfg.max_seq_len
            self.register_buffer("bias", torch.tril(torch.ones(L, L)).view(1, 1, L, L), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        kv = self.n_kv * self.head_dim
        q, k, v = self.c_attn(x).split([C, kv, kv], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        y = attention_core(self.core, self.checkpoint_core, q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v, per head (B, heads, T, head_dim)."""
        T = q.size(-2)
        if self.flash:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                                  dropout_p=self.dropout if self.training else 0.0,
                                                  is_causal=True, enable_gqa=self.n_kv != self.n_head)
        if self.n_kv != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v


class GPT2MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.ffn, bias=cfg.has_bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(cfg.ffn, cfg.d_model, bias=cfg.has_bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.has_bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.has_bias)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# -- Llama ------------------------------------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_size
        kv = self.n_kv * self.head_dim
        # q/o are n_head * head_dim wide (HF's `head_dim` may make that differ from d_model); biases as
        # modeling_llama.py (q/k/v/o: attention_bias) or modeling_qwen2.py (q/k/v only) have them
        self.q_proj = nn.Linear(cfg.d_model, cfg.attn_dim, bias=cfg.has_bias)
        self.k_proj = nn.Linear(cfg.d_model, kv, bias=cfg.has_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv, bias=cfg.has_bias)
        self.o_proj = nn.Linear(cfg.attn_dim, cfg.d_model, bias=cfg.has_out_bias)
        self.dropout = cfg.dropout
        self.sdpa = cfg.attention == "sdpa"
        self.checkpoint_core = False  # "selective": the core runs under its own checkpoint

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor | None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        core = functools.partial(self.core, causal=causal)
        y = attention_core(core, self.checkpoint_core, q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.o_proj(y)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v with grouped-query heads (B, heads, T, head_dim)."""
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                  is_causal=True, enable_gqa=self.n_kv != self.n_head)
        if self.n_kv != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        att = F.dropout(att, p=self.dropout, training=self.training)
        return att @ v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=cfg.has_mlp_bias)  # modeling_llama.py: mlp_bias
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=cfg.has_mlp_bias)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d_model, bias=cfg.has_mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        # registration order = transformer_params order: attention, MLP, then the two norms
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.post_attention_layernorm = nn.RMSNorm(cfg.d_model, eps=1e-6)

    def forward(self, x, cos, sin, causal):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, causal)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        hd = cfg.head_size
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.eager = cfg.attention == "eager"
        self.segments: tuple[Segment, ...] = _segments(None, cfg.n_layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.embed_tokens(idx)
        pos = torch.arange(T, device=idx.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril() if self.eager else None
        for seg in self.segments:
            def run(x_, layers=[self.layers[i] for i in seg.layers]):
                for layer in layers:
                    x_ = layer(x_, cos, sin, causal)
                return x_
            x = run_segment(run, seg.wrap, x)
        return self.norm(x)


# -- HF transformers GPT-2 --------------------------------------------------------------------------

def hf_gpt2_config(cfg: TransformerConfig):
    """The `transformers.GPT2Config` of `cfg`: one dropout rate for embeddings, attention and residuals,
    the attention implementation and MLP activation by HF's names, no KV cache (HF's Trainer trains with
    `use_cache=False`, `TrainingArguments.use_cache`'s default), bos/eos inside the vocabulary."""
    from transformers import GPT2Config

    last_token = cfg.vocab_size - 1
    return GPT2Config(n_layer=cfg.n_layer, n_embd=cfg.d_model, n_head=cfg.n_head, vocab_size=cfg.vocab_size,
                      n_positions=cfg.max_seq_len, n_inner=cfg.d_ff, activation_function=cfg.mlp_activation,
                      resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                      tie_word_embeddings=cfg.tied, attn_implementation=cfg.attention, use_cache=False,
                      bos_token_id=last_token, eos_token_id=last_token)


@functools.cache
def _hf_gpt2_adapter_class():
    """`GPT2LMHeadModel` with nanoGPT's call: `logits, loss = model(idx, targets)`.

    A subclass (not a wrapper) so that `named_parameters()` are HF's own names. HF shifts the labels
    inside its loss, so the labels are the input ids themselves (HF's convention); `targets` only says
    whether to compute the loss. Defined on first use: importing transformers takes seconds.
    """
    from transformers import GPT2LMHeadModel

    class HFGPT2Adapter(GPT2LMHeadModel):
        def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
            out = super().forward(input_ids=idx, labels=idx if targets is not None else None, use_cache=False)
            return out.logits, out.loss

    return HFGPT2Adapter


def hf_gpt2(cfg: TransformerConfig, checkpointing: str = "none") -> nn.Module:
    """HF's GPT2LMHeadModel for `cfg`; `checkpointing == "full"` checkpoints every GPT2Block with torch's
    non-reentrant checkpoint, through HF's own switch (the only policy besides "none" it runs)."""
    if checkpointing not in HF_CHECKPOINTING:
        raise ConfigError("checkpointing", f"implementation 'hf' runs {' or '.join(HF_CHECKPOINTING)} "
                                           f"(HF's own switch), not {checkpointing!r}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("implementation", "'hf' reference models need transformers: pip install transformers") \
            from None
    model = _hf_gpt2_adapter_class()(hf_gpt2_config(cfg))
    model.loss_type = "ForCausalLM"  # the loss HF picks anyway, named so it need not warn that it guessed
    if checkpointing == "full":
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # newer transformers: the old name is an alias
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


HF_CHECKPOINTING = ("none", "full")


# -- the model --------------------------------------------------------------------------------------

class GPT(nn.Module):
    """nanoGPT's GPT for family "gpt2", a small Llama for family "llama"; `forward(idx, targets)`."""

    def __init__(self, cfg: TransformerConfig, checkpointing: TrainingSetup | str = "none") -> None:
        super().__init__()
        self.cfg = cfg
        self.segments = _segments(checkpointing, cfg.n_layer)  # how the blocks run (models/tape.py)
        # torchtune's chunked output + CEWithChunkedOutputLoss (chunked_ce_loss), when the setup asks for it
        self.chunks = checkpointing.loop.chunked_loss if isinstance(checkpointing, TrainingSetup) else 0
        if cfg.architecture == "gpt2":
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
                wpe=nn.Embedding(cfg.max_seq_len, cfg.d_model),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.d_model, bias=cfg.has_bias),
            ))
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tied:
                self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying
        else:
            self.model = LlamaModel(cfg)
            self.model.segments = self.segments
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tied:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)
        # activation_offload "streams": torchtune's OffloadActivations around the forward, NoOpManager on the head
        # (traces/reference/offload_streams.py; get_act_offloading_ctx_manager's hooks on `model.output`)
        self.offload_streams = None
        if isinstance(checkpointing, TrainingSetup) and checkpointing.checkpointing.activation_offload == "streams":
            from .offload_streams import offload_activations
            self.offload_streams = offload_activations(checkpointing.checkpointing.offload_stash,
                                                       checkpointing.checkpointing.offload_min_bytes)
        for seg in self.segments:
            for i in seg.layers:
                gpt2 = cfg.architecture == "gpt2"
                block = self.transformer.h[i] if gpt2 else self.model.layers[i]
                (block.attn if gpt2 else block.self_attn).checkpoint_core = seg.wrap == "selective"

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        if t > self.cfg.max_seq_len:
            raise ConfigError("seq_len", f"{t} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        offload, head = self.offload_streams or (contextlib.nullcontext(), contextlib.nullcontext())
        with offload:  # torchtune's recipes: `with activations_handling_ctx: logits = model(...)`, the loss outside
            if self.cfg.architecture == "gpt2":
                pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
                x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
                for seg in self.segments:
                    x = run_segment(nn.Sequential(*(self.transformer.h[i] for i in seg.layers)), seg.wrap, x)
                x = self.transformer.ln_f(x)
            else:
                x = self.model(idx)
            with head:
                if self.chunks:  # torchtune 0.6.1 TransformerDecoder.chunked_output
                    logits = [self.lm_head(chunk) for chunk in x.chunk(self.chunks, dim=1)]
                else:
                    logits = self.lm_head(x)
        if self.chunks:  # then its CEWithChunkedOutputLoss
            return logits, (chunked_ce_loss(self.chunks)(logits, targets) if targets is not None else None)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def chunked_ce_loss(num_output_chunks: int) -> nn.Module:
    """torchtune 0.6.1's own `CEWithChunkedOutputLoss(num_output_chunks)`, loaded from its file
    (torchtune/modules/loss/ce_chunked_output_loss.py, which imports torch alone: the package's __init__ needs a
    torchao older than torch 2.13's). Needs `pip install --no-deps torchtune==0.6.1`."""
    from .torchtune_files import load_file, torchtune_root

    root = torchtune_root()
    if root is None:
        raise ConfigError("chunked_loss", "the real chunked loss is torchtune's: "
                                          "pip install --no-deps torchtune==0.6.1")
    module = load_file("torchtune_ce_chunked_output_loss", root / "modules" / "loss" / "ce_chunked_output_loss.py")
    return module.CEWithChunkedOutputLoss(num_output_chunks)


class MLP(nn.Module):
    """`layers` = Sequential(Linear, act, ..., Linear); `forward(x, target)` -> (output, MSE loss)."""

    def __init__(self, cfg: MLPConfig, checkpointing: TrainingSetup | str = "none") -> None:
        super().__init__()
        self.cfg = cfg
        dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
        # a layer is one Linear and the activation after it; "full" checkpoints each
        self.segments = _segments(checkpointing, len(dims) - 1)
        if any(seg.wrap == "selective" for seg in self.segments):
            raise ConfigError("checkpointing", "'selective' recomputes the attention core: an MLP has none; allowed "
                                               "for MLPs: none, full, every-k, sqrt, op-policy, offload, layers")
        mods: list[nn.Module] = []
        for i in range(len(dims) - 1):
            mods.append(nn.Linear(dims[i], dims[i + 1], bias=cfg.bias))
            if i < len(dims) - 2:
                mods.append(nn.ReLU() if cfg.activation == "relu" else nn.GELU())
        self.layers = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None):
        mods = list(self.layers)
        out = x
        for seg in self.segments:
            out = run_segment(nn.Sequential(*mods[2 * seg.layers.start:2 * seg.layers.stop]), seg.wrap, out)
        return out, (F.mse_loss(out, target) if target is not None else None)


# -- the batches ---------------------------------------------------------------------------------------------------

def token_batch(cfg: TransformerConfig, setup: TrainingSetup, generator: torch.Generator):
    """One micro-batch of a transformer family (build.py `PROGRAMS`): int64 token ids and their next-token targets,
    (micro_batch, seq_len)."""
    check_seq_len(cfg, setup)
    tokens = torch.randint(0, cfg.vocab_size, (setup.batch.micro_batch, setup.batch.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def vector_batch(cfg: MLPConfig, setup: TrainingSetup, generator: torch.Generator):
    """One micro-batch of the mlp family: (micro_batch, d_in) inputs and (micro_batch, d_out) targets in the parameter
    dtype."""
    dt = TORCH_DTYPES[setup.precision.param]
    return (torch.randn(setup.batch.micro_batch, cfg.d_in, generator=generator).to(dt),
            torch.randn(setup.batch.micro_batch, cfg.d_out, generator=generator).to(dt))
