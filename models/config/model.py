"""What the model is: `TransformerConfig` (a decoder-only transformer, hand-written describers) and `MLPConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..fields import check_types, keys_of
from .base import COUNT_LIMITS, INT64_MAX, ConfigError, at_most, choice_of, positive_int

ARCHITECTURES = ("gpt2", "llama")
ATTENTION = ("eager", "sdpa")
IMPLEMENTATIONS = ("nanogpt", "hf")
GPT2_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")  # HF `activation_function` names


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer. `architecture` fixes the block layout (written `family` in scenario files,
    on the command line (--family), in traces and in messages: the key users have always written):

    gpt2: learned positions, LayerNorm with bias, GELU MLP, biases on linears, tied embeddings.
    llama: rotary positions (no parameters), RMSNorm, gated SiLU MLP, no biases, GQA.

    `implementation` says whose code runs the layout, because two codebases with the same parameters
    allocate differently:
      nanogpt  peakledger's own plain-torch models (`traces/reference/nanogpt.py`): nanoGPT for gpt2, a small
               HF-named Llama for llama.
      hf       HF transformers' GPT2LMHeadModel (gpt2 only): Conv1D projections, an additive float
               causal mask built once per forward, its own loss (logits upcast to fp32, labels shifted
               with padding), dropout layers that stay in the graph, tensors kept alive by Python
               locals until a module returns.
    `activation` is the gpt2 MLP activation by HF's `activation_function` name: "gelu" (exact, one
    fused kernel), "gelu_pytorch_tanh" (tanh approximation, one fused kernel) or "gelu_new" (HF's
    composite tanh formula: eight pointwise ops, four saved tensors). None means "gelu"; nanogpt runs
    `nn.GELU()` only. Llama's gated SiLU is fixed.

    `head_dim` is the width of one attention head (HF's `head_dim`; Mistral-NeMo: 128 with d_model 5120
    and 32 heads); None means d_model // n_head. q_proj's output and o_proj's input are n_head * head_dim
    wide (`attn_dim`), k_proj's and v_proj's n_kv_head * head_dim. Architecture gpt2 splits d_model into its
    heads: another head_dim is refused there.
    Biases: gpt2 has one switch, `bias` (every linear and norm; `out_bias` and `mlp_bias` can only agree
    with it). In llama `bias` is the q/k/v projections' biases (Qwen2 has them), `out_bias` o_proj's
    (HF Llama's `attention_bias` sets both) and `mlp_bias` gate/up/down_proj's (HF Llama's `mlp_bias`);
    None means none.
    """

    name: str
    architecture: str = field(metadata={"key": "family"})  # models/fields.py: a field's key
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    max_seq_len: int
    n_kv_head: int | None = None  # None: = n_head (multi-head attention)
    d_ff: int | None = None  # None: 4 * d_model
    tied_embeddings: bool | None = None  # None: the architecture's default
    bias: bool | None = None  # None: the architecture's default
    dropout: float = 0.0
    attention: str = "sdpa"
    implementation: str = "nanogpt"
    activation: str | None = None
    head_dim: int | None = None  # None: d_model // n_head
    out_bias: bool | None = None  # attention output projection's bias; None: the architecture's default
    mlp_bias: bool | None = None  # MLP projections' biases; None: the architecture's default
    # mixture of experts (models/moe.py): each MLP is `num_local_experts` SwiGLU experts d_ff wide and a router
    # sending each token to `num_experts_per_tok` of them (HF Mixtral); None: a dense MLP
    num_local_experts: int | None = None
    num_experts_per_tok: int | None = None
    experts_implementation: str | None = None  # HF's: "grouped_mm" (None, its default) or "eager" (a loop over experts)

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        at_most(self, "n_layer")
        if self.architecture not in ARCHITECTURES:  # (choice_of's words, under the field's key)
            raise ConfigError("family", f"unknown value {self.architecture!r}; allowed: {', '.join(ARCHITECTURES)}")
        choice_of(self, "attention", ATTENTION)
        positive_int(self, "n_layer", "d_model", "n_head", "vocab_size", "max_seq_len")
        if self.n_kv_head is not None:
            positive_int(self, "n_kv_head")
        if self.d_ff is not None:
            positive_int(self, "d_ff")
        if self.head_dim is not None:
            positive_int(self, "head_dim")
        elif self.d_model % self.n_head:
            raise ConfigError("n_head", f"n_head={self.n_head} must divide d_model={self.d_model} "
                                        "(or give head_dim)")
        if self.n_head % self.kv_heads:
            raise ConfigError("n_kv_head", f"n_kv_head={self.kv_heads} must divide n_head={self.n_head}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        choice_of(self, "implementation", IMPLEMENTATIONS)
        if self.activation is not None:
            choice_of(self, "activation", GPT2_ACTIVATIONS)
            if self.architecture != "gpt2":
                raise ConfigError("activation", f"only family gpt2 takes an activation; {self.architecture} runs "
                                                "gated SiLU")
            if self.implementation == "nanogpt" and self.activation != "gelu":
                raise ConfigError("activation", f"implementation nanogpt runs nn.GELU() (gelu); {self.activation!r} "
                                                "needs implementation = 'hf'")
        self._check_heads_and_biases()
        if self.num_local_experts is not None or self.num_experts_per_tok is not None or self.experts_implementation:
            _check_experts(self)
        elif self.implementation == "hf":
            self._check_hf_gpt2()

    def _check_heads_and_biases(self) -> None:
        """gpt2 splits d_model into its heads and has one bias switch; llama's rotary embedding rotates
        half of each head, so a head's width must be even."""
        if self.architecture == "gpt2":
            if self.head_dim is not None and self.head_dim * self.n_head != self.d_model:
                raise ConfigError("head_dim", f"family gpt2 splits d_model={self.d_model} into n_head={self.n_head} "
                                              f"heads: head_dim {self.head_dim} is modelled for family llama only")
            for name in ("out_bias", "mlp_bias"):
                value = getattr(self, name)
                if value is not None and value != self.has_bias:
                    raise ConfigError(name, f"family gpt2 has one bias switch, bias ({self.has_bias}): {name} "
                                            f"must be left out or equal it")
        elif self.head_size % 2:
            raise ConfigError("head_dim", f"llama's rotary embedding rotates half of each head: the head width "
                                          f"({self.head_size}) must be even")

    def _check_hf_gpt2(self) -> None:
        """HF's GPT2LMHeadModel has fixed parts: the fields that would describe another model are refused."""
        if self.architecture != "gpt2":
            raise ConfigError("implementation", f"'hf' is modelled for family gpt2 only, got {self.architecture!r}; "
                                                "allowed: nanogpt for llama")
        if self.kv_heads != self.n_head:
            raise ConfigError("n_kv_head", "HF GPT-2 has multi-head attention only: n_kv_head must equal n_head")
        if self.bias is False:
            raise ConfigError("bias", "HF GPT-2 always has biases (Conv1D and LayerNorm)")

    @property
    def mlp_activation(self) -> str:
        """The activation that runs: `activation`, or the architecture's own (gelu for gpt2, silu for llama)."""
        return self.activation or ("gelu" if self.architecture == "gpt2" else "silu")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_size(self) -> int:
        """The width of one attention head: `head_dim`, or d_model // n_head."""
        return self.d_model // self.n_head if self.head_dim is None else self.head_dim

    @property
    def attn_dim(self) -> int:
        """All query heads together: q_proj's output and o_proj's input width (d_model in gpt2)."""
        return self.n_head * self.head_size

    @property
    def ffn(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def tied(self) -> bool:
        return (self.architecture == "gpt2") if self.tied_embeddings is None else self.tied_embeddings

    @property
    def has_bias(self) -> bool:
        return (self.architecture == "gpt2") if self.bias is None else self.bias

    @property
    def has_out_bias(self) -> bool:
        """Whether the attention output projection (c_proj / o_proj) has a bias."""
        return self.has_bias if self.architecture == "gpt2" else bool(self.out_bias)

    @property
    def has_mlp_bias(self) -> bool:
        """Whether the MLP projections (c_fc, c_proj / gate, up, down_proj) have biases."""
        return self.has_bias if self.architecture == "gpt2" else bool(self.mlp_bias)

    @property
    def gated_mlp(self) -> bool:
        return self.architecture == "llama"

    @property
    def blocks(self) -> str:
        """The module path of the block list: a block's parameters and ops are named `<blocks>.<i>.` (nanoGPT's
        names for gpt2, HF's for llama)."""
        return "transformer.h" if self.architecture == "gpt2" else "model.layers"


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")  # transformers/integrations/moe.py, models/moe.py


def _check_experts(cfg: TransformerConfig) -> None:
    """MoE is modelled as HF's MixtralForCausalLM runs it (models/moe.py): architecture llama, implementation hf,
    SDPA without dropout, both expert counts given, top-k <= experts."""
    if cfg.experts_implementation is not None and cfg.num_local_experts is None:
        raise ConfigError("experts_implementation", f"applies to mixture-of-experts models (num_local_experts); "
                                                    f"{cfg.name!r} has no experts")
    for name in ("num_local_experts", "num_experts_per_tok"):
        if getattr(cfg, name) is None:
            raise ConfigError(name, "a mixture of experts needs both num_local_experts and num_experts_per_tok")
        positive_int(cfg, name)
    if cfg.num_experts_per_tok > cfg.num_local_experts:
        raise ConfigError("num_experts_per_tok", f"{cfg.num_experts_per_tok} is more than num_local_experts "
                                                 f"{cfg.num_local_experts}")
    if cfg.num_local_experts > COUNT_LIMITS["n_layer"][0]:
        raise ConfigError("num_local_experts", f"{cfg.num_local_experts:,} is over the limit of 1,000 experts")
    wanted = dict(family="llama", implementation="hf", attention="sdpa", dropout=0.0)  # by key (models/fields.py)
    for key, value in wanted.items():
        got = getattr(cfg, keys_of(TransformerConfig)[key])
        if got != value:
            raise ConfigError(key, f"experts are modelled as HF's MixtralForCausalLM runs them: {key} must be "
                                   f"{value!r}, got {got!r}")
    if cfg.bias or cfg.out_bias or cfg.mlp_bias:
        raise ConfigError("bias", "HF Mixtral has no biases: bias, out_bias and mlp_bias must be left out or false")
    if cfg.experts_implementation is not None:
        choice_of(cfg, "experts_implementation", EXPERTS_IMPLEMENTATIONS)


@dataclass(frozen=True)
class MLPConfig:
    """A stack of Linear layers with an activation between them, and a loss over the last layer."""

    name: str
    d_in: int
    hidden: tuple[int, ...]
    d_out: int
    bias: bool = True
    activation: str = "relu"

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        if len(self.hidden) > COUNT_LIMITS["hidden"][0]:
            raise ConfigError("hidden", f"{len(self.hidden):,} layers is over the limit of "
                                        f"{COUNT_LIMITS['hidden'][0]:,} ({COUNT_LIMITS['hidden'][1]})")
        positive_int(self, "d_in", "d_out")
        if not self.hidden or any(isinstance(h, bool) or not isinstance(h, int) or not 0 < h <= INT64_MAX
                                  for h in self.hidden):
            raise ConfigError("hidden", f"must be a non-empty list of positive integers, got {self.hidden!r}")
        choice_of(self, "activation", ("relu", "gelu"))

