"""Configs: what the model is and how it is trained. Frozen dataclasses, validated on creation.

A describer reads a model config (`TransformerConfig` or `MLPConfig`) and a `TrainingSetup` and
produces an op graph. Every invalid value raises `ConfigError` naming the field and what is allowed,
so the CLI can turn it into a clear message (exit 2) instead of a traceback or a wrong number.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..simulator.files import InputError, digits_message, read_text, too_many_digits
from .dp_engines import DP_ENGINES as DP_ENGINE_REGISTRY
from .dp_engines import knob_rules as engine_knob_rules
from .fields import check_types
from .precision import PRECISION_TABLE, PRECISIONS, Precision

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int64": 8, "bool": 1, "int32": 4}
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                 "uint8": "int8", "long": "int64"}


class ConfigError(InputError):
    """A bad input value: `field` names it, the message says what is allowed."""


CONFIG_FILE_LIMIT = 4 << 20  # bytes: a scenario or config.json is a few KiB; /dev/zero is refused


def read_config_file(path, field_name: str, parse, parse_error: type[Exception], kind: str):
    """Read and parse a JSON / TOML input file (at most CONFIG_FILE_LIMIT bytes of UTF-8); a missing, binary,
    oversized, too deeply nested or malformed file is a ConfigError naming the field."""
    text = read_text(path, field_name, CONFIG_FILE_LIMIT)
    try:
        return parse(text)
    except RecursionError:
        raise ConfigError(field_name, f"{path} is nested too deeply to be a {kind} config") from None
    except parse_error as e:
        raise ConfigError(field_name, f"{path} is not valid {kind}: {e}") from None
    except ValueError as e:
        if too_many_digits(e):
            raise ConfigError(field_name, digits_message(path)) from None
        raise


def dtype_name(value: str, field_name: str = "dtype") -> str:
    name = DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if name not in DTYPE_BYTES:
        raise ConfigError(field_name, f"unknown dtype {value!r}; allowed: {', '.join(DTYPE_BYTES)}")
    return name


def dtype_bytes(dtype: str) -> int:
    size = DTYPE_BYTES.get(dtype)  # the canonical names, on the hot path (every block of every op)
    return size if size is not None else DTYPE_BYTES[dtype_name(dtype)]


INT64_MAX = 2**63 - 1  # torch sizes are int64 (c10::SymInt): no dimension, count or element number is larger


def _positive_int(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if value > INT64_MAX:
            raise ConfigError(name, f"{value} is over 2^63 - 1, the largest size torch can hold (int64)")


# Counts that set how many ops are described and simulated are bounded, so no input makes unbounded work;
# sizes (widths, vocabulary, micro-batch, sequence) are exact Python ints up to INT64_MAX and cost nothing more.
COUNT_LIMITS = {
    "n_layer": (1000, "the deepest published LLMs have under 200 layers"),
    "hidden": (1000, "layers of an MLP"),
    "grad_accum": (1024, "micro-batches per optimizer step; each one is simulated op by op"),
    "world_size": (1 << 24, "ranks; identical ranks are simulated once"),
    "pp": (1024, "pipeline stages; every pipeline rank is simulated"),
    "virtual_stages": (64, "stages per pipeline rank"),
}


def _at_most(obj, *names: str) -> None:
    for name in names:
        limit, why = COUNT_LIMITS[name]
        value = getattr(obj, name)
        if isinstance(value, int) and value > limit:
            raise ConfigError(name, f"{value:,} is over the limit of {limit:,} ({why})")


def _choice(obj, name: str, allowed) -> None:
    value = getattr(obj, name)
    if value not in allowed:
        raise ConfigError(name, f"unknown value {value!r}; allowed: {', '.join(map(str, allowed))}")


FAMILIES = ("gpt2", "llama")
ATTENTION = ("eager", "sdpa")
IMPLEMENTATIONS = ("nanogpt", "hf")
GPT2_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")  # HF `activation_function` names


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer. `family` fixes the block layout:

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
    wide (`attn_dim`), k_proj's and v_proj's n_kv_head * head_dim. Family gpt2 splits d_model into its
    heads: another head_dim is refused there.
    Biases: gpt2 has one switch, `bias` (every linear and norm; `out_bias` and `mlp_bias` can only agree
    with it). In llama `bias` is the q/k/v projections' biases (Qwen2 has them), `out_bias` o_proj's
    (HF Llama's `attention_bias` sets both) and `mlp_bias` gate/up/down_proj's (HF Llama's `mlp_bias`);
    None means none.
    """

    name: str
    family: str
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    max_seq_len: int
    n_kv_head: int | None = None  # None: = n_head (multi-head attention)
    d_ff: int | None = None  # None: 4 * d_model
    tied_embeddings: bool | None = None  # None: family default
    bias: bool | None = None  # None: family default
    dropout: float = 0.0
    attention: str = "sdpa"
    implementation: str = "nanogpt"
    activation: str | None = None
    head_dim: int | None = None  # None: d_model // n_head
    out_bias: bool | None = None  # attention output projection's bias; None: family default
    mlp_bias: bool | None = None  # MLP projections' biases; None: family default
    # mixture of experts (models/moe.py): each MLP is `num_local_experts` SwiGLU experts d_ff wide and a router
    # sending each token to `num_experts_per_tok` of them (HF Mixtral); None: a dense MLP
    num_local_experts: int | None = None
    num_experts_per_tok: int | None = None
    experts_implementation: str | None = None  # HF's: "grouped_mm" (None, its default) or "eager" (a loop over experts)

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        _at_most(self, "n_layer")
        _choice(self, "family", FAMILIES)
        _choice(self, "attention", ATTENTION)
        _positive_int(self, "n_layer", "d_model", "n_head", "vocab_size", "max_seq_len")
        if self.n_kv_head is not None:
            _positive_int(self, "n_kv_head")
        if self.d_ff is not None:
            _positive_int(self, "d_ff")
        if self.head_dim is not None:
            _positive_int(self, "head_dim")
        elif self.d_model % self.n_head:
            raise ConfigError("n_head", f"n_head={self.n_head} must divide d_model={self.d_model} "
                                        "(or give head_dim)")
        if self.n_head % self.kv_heads:
            raise ConfigError("n_kv_head", f"n_kv_head={self.kv_heads} must divide n_head={self.n_head}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        _choice(self, "implementation", IMPLEMENTATIONS)
        if self.activation is not None:
            _choice(self, "activation", GPT2_ACTIVATIONS)
            if self.family != "gpt2":
                raise ConfigError("activation", f"only family gpt2 takes an activation; {self.family} runs gated SiLU")
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
        if self.family == "gpt2":
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
        if self.family != "gpt2":
            raise ConfigError("implementation", f"'hf' is modelled for family gpt2 only, got {self.family!r}; "
                                                "allowed: nanogpt for llama")
        if self.kv_heads != self.n_head:
            raise ConfigError("n_kv_head", "HF GPT-2 has multi-head attention only: n_kv_head must equal n_head")
        if self.bias is False:
            raise ConfigError("bias", "HF GPT-2 always has biases (Conv1D and LayerNorm)")

    @property
    def mlp_activation(self) -> str:
        """The activation that runs: `activation`, or the family's own (gelu for gpt2, silu for llama)."""
        return self.activation or ("gelu" if self.family == "gpt2" else "silu")

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
        return (self.family == "gpt2") if self.tied_embeddings is None else self.tied_embeddings

    @property
    def has_bias(self) -> bool:
        return (self.family == "gpt2") if self.bias is None else self.bias

    @property
    def has_out_bias(self) -> bool:
        """Whether the attention output projection (c_proj / o_proj) has a bias."""
        return self.has_bias if self.family == "gpt2" else bool(self.out_bias)

    @property
    def has_mlp_bias(self) -> bool:
        """Whether the MLP projections (c_fc, c_proj / gate, up, down_proj) have biases."""
        return self.has_bias if self.family == "gpt2" else bool(self.mlp_bias)

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")  # transformers/integrations/moe.py, models/moe.py


def _check_experts(cfg: TransformerConfig) -> None:
    """MoE is modelled as HF's MixtralForCausalLM runs it (models/moe.py): family llama, implementation hf,
    SDPA without dropout, both expert counts given, top-k <= experts."""
    if cfg.experts_implementation is not None and cfg.num_local_experts is None:
        raise ConfigError("experts_implementation", f"applies to mixture-of-experts models (num_local_experts); "
                                                    f"{cfg.name!r} has no experts")
    for name in ("num_local_experts", "num_experts_per_tok"):
        if getattr(cfg, name) is None:
            raise ConfigError(name, "a mixture of experts needs both num_local_experts and num_experts_per_tok")
        _positive_int(cfg, name)
    if cfg.num_experts_per_tok > cfg.num_local_experts:
        raise ConfigError("num_experts_per_tok", f"{cfg.num_experts_per_tok} is more than num_local_experts "
                                                 f"{cfg.num_local_experts}")
    if cfg.num_local_experts > COUNT_LIMITS["n_layer"][0]:
        raise ConfigError("num_local_experts", f"{cfg.num_local_experts:,} is over the limit of 1,000 experts")
    wanted = dict(family="llama", implementation="hf", attention="sdpa", dropout=0.0)
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            raise ConfigError(name, f"experts are modelled as HF's MixtralForCausalLM runs them: {name} must be "
                                    f"{value!r}, got {getattr(cfg, name)!r}")
    if cfg.bias or cfg.out_bias or cfg.mlp_bias:
        raise ConfigError("bias", "HF Mixtral has no biases: bias, out_bias and mlp_bias must be left out or false")
    if cfg.experts_implementation is not None:
        _choice(cfg, "experts_implementation", EXPERTS_IMPLEMENTATIONS)


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
        _positive_int(self, "d_in", "d_out")
        if not self.hidden or any(isinstance(h, bool) or not isinstance(h, int) or not 0 < h <= INT64_MAX
                                  for h in self.hidden):
            raise ConfigError("hidden", f"must be a non-empty list of positive integers, got {self.hidden!r}")
        _choice(self, "activation", ("relu", "gelu"))


def _checkpoint_layers(setup) -> None:
    """`checkpoint_layers`: distinct layer indices >= 0, given only with checkpointing "layers"."""
    layers = setup.checkpoint_layers
    if not isinstance(layers, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        raise ConfigError("checkpoint_layers", f"must be a list of layer indices >= 0, got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ConfigError("checkpoint_layers", f"lists a layer twice: {layers!r}")
    if layers and setup.checkpointing != "layers":
        raise ConfigError("checkpoint_layers", f"only applies to checkpointing \"layers\", not {setup.checkpointing!r}")


def _checkpoint_io_fields(setup) -> None:
    """`checkpoint_every` >= 0, `save_mode` / `load_mode` known; a full state dict needs an engine whose
    gather is modelled (not ZeroRedundancyOptimizer's consolidate_state_dict)."""
    every = setup.checkpoint_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError("checkpoint_every", f"must be an integer >= 0 (0 = never save), got {every!r}")
    _choice(setup, "save_mode", SAVE_MODES)
    _choice(setup, "load_mode", LOAD_MODES)
    if setup.save_mode.startswith("full-") and setup.dp_engine == "zero-redundancy-optimizer":
        raise ConfigError("save_mode", f"{setup.save_mode!r} with zero-redundancy-optimizer (consolidate_state_dict) "
                                       "is not modelled; allowed there: torch-save, sharded, async")


def _optimizer_offload_fields(setup) -> None:
    """`optimizer_offload` and its knobs (models/optimizers.py): a mode this describer models, on an
    optimizer with tensor states, under an engine that leaves the torch optimizer's states alone."""
    _choice(setup, "optimizer_offload", OPTIMIZER_OFFLOADS)
    _choice(setup, "offload_first_step", OFFLOAD_FIRST_STEPS)
    _positive_int(setup, "offload_chunk_params")
    prefetch = setup.offload_prefetch
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError("offload_prefetch", f"must be an integer >= 0, got {prefetch!r}")
    mode = setup.optimizer_offload
    if setup.offload_first_step != "whole" and mode != "chunked":
        raise ConfigError("offload_first_step", f"{setup.offload_first_step!r} only applies to optimizer_offload "
                                                f"\"chunked\", not {mode!r}")
    if mode == "none":
        return
    if setup.optimizer == "sgd":
        raise ConfigError("optimizer_offload", "optimizer 'sgd' keeps no state to offload; allowed with: "
                                               "sgd-momentum, adam, adamw, amsgrad")
    if setup.optimizer == "adam-8bit":
        raise ConfigError("optimizer_offload", "bitsandbytes' 8-bit states (its paged optimizers) are not modelled "
                                               "for offload; allowed with: sgd-momentum, adam, adamw, amsgrad")
    if setup.dp_engine == "deepspeed" and (setup.world_size > 1 or setup.zero_stage):
        raise ConfigError("optimizer_offload", "DeepSpeed offloads through its own offload_optimizer (ZeRO-Offload: "
                                               "the step runs on the CPU), not modelled; allowed with one device, "
                                               "fsdp2, ddp or zero-redundancy-optimizer")
    if setup.load_mode != "none":
        raise ConfigError("load_mode", f"{setup.load_mode!r} with optimizer_offload {mode!r} (states loaded, then "
                                       "moved to the host) is not modelled; allowed there: none")
    if setup.save_mode.startswith("full-") and setup.world_size > 1:
        raise ConfigError("save_mode", f"{setup.save_mode!r} gathers sharded states on the device; with host-resident "
                                       "offloaded states that is not modelled; allowed there: torch-save, sharded, "
                                       "async")


QUANTIZE = ("none", "nf4")  # models/lora.py


def _lora_fields(setup) -> None:
    """LoRA knobs (models/lora.py): rank >= 0, alpha > 0, dropout in [0, 1), quantize known; nf4 needs adapters
    (transformers' Trainer refuses to fine-tune a purely quantized model); one device only."""
    r = setup.lora_r
    if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r > INT64_MAX:
        raise ConfigError("lora_r", f"must be an integer >= 0 (0 = no LoRA), got {r!r}")
    alpha, p = setup.lora_alpha, setup.lora_dropout
    if not 0 < alpha < float("inf"):
        raise ConfigError("lora_alpha", f"must be a finite number > 0 (scaling = lora_alpha / lora_r), got {alpha!r}")
    if not 0 <= p < 1:
        raise ConfigError("lora_dropout", f"must be a number in [0, 1), got {p!r}")
    if len(set(setup.lora_targets)) != len(setup.lora_targets) or not all(setup.lora_targets):
        raise ConfigError("lora_targets", f"must be distinct non-empty module names, got {setup.lora_targets!r}")
    _choice(setup, "quantize", QUANTIZE)
    if setup.quantize != "none" and r == 0:
        raise ConfigError("quantize", f"{setup.quantize!r} freezes every base linear in 4 bits: nothing would train; "
                                      "give lora_r > 0 (QLoRA), or quantize none")
    if setup.quantize != "none" and setup.precision not in ("fp32", "bf16"):
        raise ConfigError("quantize", f"{setup.quantize!r} is modelled with precision fp32 or bf16 "
                                      f"(Linear4bit's compute "
                                      f"dtype), not {setup.precision!r}; allowed: fp32, bf16")
    if r and (setup.world_size > 1 or setup.zero_stage or setup.dp_engine != "deepspeed"):
        raise ConfigError("lora_r", "LoRA is modelled on one device without a data-parallel engine; allowed with it: "
                                    "world_size 1, zero_stage 0, dp_engine left out")
    if r and setup.checkpointing in ("offload", "op-policy"):  # what they keep of frozen / 4-bit linears: unmodelled
        raise ConfigError("checkpointing", f"{setup.checkpointing!r} with LoRA is not modelled; allowed with it: none, "
                                           "full, every-k, selective, sqrt, layers")
    if r and setup.optimizer_offload != "none":
        raise ConfigError("lora_r", "LoRA with optimizer_offload is not modelled; allowed with it: optimizer_offload "
                                    "none")


def _build_field(setup) -> None:
    """`build` (BUILDS): "device-fp32" is the program of one device, or of FSDP2 ranks, that builds the model on its
    GPU; what model parallelism, DeepSpeed's or DDP's wrapping, the fp32 master copies of a mixed precision outside
    FSDP2, 4-bit base weights or a model built on the meta device (meta-assign) would do to it is not modelled."""
    _choice(setup, "build", BUILDS)
    if setup.build == "direct":
        return
    if setup.tp * setup.pp * setup.cp * setup.ep > 1:
        what, needs = f"tp {setup.tp}, pp {setup.pp}, cp {setup.cp}, ep {setup.ep}", "tp, pp, cp and ep 1"
    elif setup.dp_engine != "fsdp2" and (setup.world_size > 1 or setup.zero_stage or setup.dp_engine != "deepspeed"):
        what = f"dp_engine {setup.dp_engine}, world_size {setup.world_size}, zero_stage {setup.zero_stage}"
        needs = "one device (dp_engine and zero_stage left out) or dp_engine fsdp2"
    elif setup.master_dtype and setup.dp_engine != "fsdp2":
        what, needs = (f"precision {setup.precision} outside fsdp2",
                       "precision fp32, bf16 or *-autocast, or dp_engine fsdp2")
    elif setup.quantize != "none":
        what, needs = f"quantize {setup.quantize}", "quantize none"
    elif setup.load_mode == "meta-assign":
        what, needs = "load_mode meta-assign (a model built on the meta device)", "load_mode none, full-then-device " \
                                                                                  "or map-to-device"
    else:
        return
    raise ConfigError("build", f"{setup.build!r} is not modelled with {what} (it needs {needs}); allowed here: "
                               f"{BUILDS[0]}")


def _model_parallel_fields(setup) -> None:
    """The model-parallel degrees: positive, dividing world_size (= dp x tp x pp x cp), ep borrowed from dp x cp
    as torchtitan's ParallelDims._validate takes it (ep % cp == 0 and (dp x cp) % ep == 0, its etp = tp case);
    the schedule's own micro-batch rules, as torch.distributed.pipelining checks them; and what pipeline
    parallelism is not simulated with yet. What needs the model (tp dividing the heads, stages <= layers, ep
    needing experts) is checked when the model is described (models/parallel/checks.py `check_model_parallel`),
    and so are the combinations of tp, cp, ep and sequence_parallel not simulated yet."""
    _positive_int(setup, "pp", "virtual_stages", "tp", "cp", "ep")
    _at_most(setup, "pp", "virtual_stages")
    _choice(setup, "pp_schedule", PP_SCHEDULES)
    n = setup.world_size
    for name in ("tp", "pp", "cp", "ep"):
        degree = getattr(setup, name)
        if n % degree:
            raise ConfigError(name, f"{name}={degree} does not divide world_size={n} (world_size = dp x tp x pp x cp): "
                                    f"give a world_size that is a multiple of {degree}")
    model_parallel = setup.tp * setup.pp * setup.cp
    if n % model_parallel:
        raise ConfigError("world_size", f"world_size={n} is not a multiple of tp x pp x cp = {setup.tp} x {setup.pp} x "
                                        f"{setup.cp} = {model_parallel} (world_size = dp x tp x pp x cp)")
    dp = n // model_parallel
    if setup.ep > 1 and (setup.ep % setup.cp or (dp * setup.cp) % setup.ep):
        raise ConfigError("ep", f"ep={setup.ep} takes its ranks from dp x cp = {dp} x {setup.cp} (torchtitan "
                                "ParallelDims): ep must be a multiple of cp and divide dp x cp")
    if setup.sequence_parallel and setup.tp == 1:
        raise ConfigError("sequence_parallel", "sequence parallelism splits the sequence over the tensor-parallel "
                                               "ranks: it needs tp > 1")
    _pipeline_schedule(setup)


def _pipeline_schedule(setup) -> None:
    """Stages per rank and micro-batches per step for `pp_schedule`, as torch/distributed/pipelining/schedules.py
    refuses them (torch 2.13): ScheduleGPipe and Schedule1F1B are single-stage schedules (one stage per rank);
    Schedule1F1B.__init__ raises when n_microbatches < the number of stages; ScheduleInterleaved1F1B.__init__
    when n_microbatches % number_of_rounds != 0, number_of_rounds = max(1, n_microbatches // pp_group_size) (a
    multi-stage schedule: torchtitan's pipeline_llm asks for >= 2 stages per rank); ScheduleZBVZeroBubble.__init__
    when a rank does not hold exactly 2 stages. grad_accum is the number of micro-batches (n_microbatches)."""
    schedule, v, pp, m = setup.pp_schedule, setup.virtual_stages, setup.pp, setup.grad_accum
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ConfigError("virtual_stages", f"{schedule} runs one stage per rank (a single-stage schedule), got "
                                            f"virtual_stages={v}; allowed: 1, or pp_schedule interleaved-1f1b / zbv")
    if schedule == "interleaved-1f1b" and v < 2:
        raise ConfigError("virtual_stages", f"interleaved-1f1b runs several stages per rank: virtual_stages must be "
                                            f">= 2, got {v}")
    if schedule == "zbv" and v != 2:
        raise ConfigError("virtual_stages", f"zbv runs exactly 2 stages per rank (a V: stages r and 2 x pp - 1 - r), "
                                            f"got virtual_stages={v}")
    if pp == 1:
        return
    if schedule == "1f1b" and m < pp:
        raise ConfigError("grad_accum", f"1f1b needs at least as many micro-batches as stages (torch's Schedule1F1B): "
                                        f"grad_accum={m} < pp={pp}; give grad_accum >= {pp}")
    rounds = max(1, m // pp)
    if schedule == "interleaved-1f1b" and m % rounds:
        raise ConfigError("grad_accum", f"interleaved-1f1b runs the micro-batches in rounds of pp: number_of_rounds = "
                                        f"max(1, {m} // {pp}) = {rounds} must divide grad_accum={m} (torch's "
                                        f"ScheduleInterleaved1F1B); allowed e.g. {', '.join(map(str, _rounds_ok(pp)))}")


def _rounds_ok(pp: int) -> list[int]:
    """The first few micro-batch counts ScheduleInterleaved1F1B accepts on `pp` ranks."""
    return [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0][:6]


OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "amsgrad", "adam-8bit")
OPTIMIZER_IMPLS = ("foreach", "for-loop", "fused")
# "forward": each step is `out = model(batch)` with autograd on (no torch.no_grad) and no loss, backward or
# optimizer step; every saved tensor and the output live until the step ends and the caller drops `out`
PASSES = ("train", "forward")
CHECKPOINTING = ("none", "full", "every-k", "selective", "sqrt", "op-policy", "offload", "layers")  # models/tape.py
DP_ENGINES = tuple(DP_ENGINE_REGISTRY)  # models/dp_engines.py
SAVE_MODES = ("torch-save", "full-rank0", "full-rank0-offload", "full-all", "sharded", "async")  # checkpoint_io.py
LOAD_MODES = ("none", "full-then-device", "map-to-device", "meta-assign")  # checkpoint_io.py
# how the parameters reach the device before training (models/parallel/engine.py `Engine.load`): "direct" = each
# allocated once in its training dtype (from_pretrained(..., torch_dtype=...), or a model moved from the CPU);
# "device-fp32" = built on the device in fp32 (`with torch.device("cuda"): cls(config)`), cast by model.to(dtype)
# where the parameters are 16-bit, then under FSDP2 each unit's fully_shard copies
BUILDS = ("direct", "device-fp32")
OPTIMIZER_OFFLOADS = ("none", "states", "chunked")  # models/optimizers.py
OFFLOAD_FIRST_STEPS = ("whole", "chunked")
# pipeline schedules (models/parallel/stages.py), as torch.distributed.pipelining names their classes:
# ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
# fsdp2's MixedPrecisionPolicy.reduce_dtype: "grad" = torch's None (the gradients' own dtype, the param_dtype)
REDUCE_DTYPES = ("grad", "fp32", "bf16", "fp16")


# A knob set by the user that the rest of the setup never reads is refused, not ignored: field -> (applies?, to what);
# a data-parallel engine's own knobs are declared with the engine (models/dp_engines.py).
# Which engine reads which knob: models/dp_engines.py; offload: models/offload.py.
KNOB_APPLIES = {
    "checkpoint_every_k": (lambda s: s.checkpointing == "every-k", "checkpointing every-k"),
    "checkpoint_every": (lambda s: s.checkpoint_every <= s.steps,
                         "checkpoint_every <= steps (a save within the steps simulated; raise --steps)"),
    "save_mode": (lambda s: s.checkpoint_every > 0, "checkpoint_every > 0 (a run that saves)"),
    "offload_chunk_params": (lambda s: s.optimizer_offload == "chunked", "optimizer_offload chunked"),
    "offload_prefetch": (lambda s: s.optimizer_offload == "chunked", "optimizer_offload chunked"),
    "lora_alpha": (lambda s: s.lora_r > 0, "lora_r > 0 (LoRA)"),
    "lora_dropout": (lambda s: s.lora_r > 0, "lora_r > 0 (LoRA)"),
    "lora_targets": (lambda s: s.lora_r > 0, "lora_r > 0 (LoRA)"),
    "frozen": (lambda s: s.lora_r == 0, "lora_r 0 (LoRA freezes the whole base model itself)"),
    "pp_schedule": (lambda s: s.pp > 1, "pp > 1 (pipeline parallelism)"),
    "virtual_stages": (lambda s: s.pp > 1, "pp > 1 (pipeline parallelism)"),
}


def check_given_knobs(setup, given) -> None:
    """Each field in `given` (the ones the user set) must be read by this setup: ConfigError naming the first
    that is not (a DeepSpeed bucket size under FSDP2, a chunk size without chunked offload, ...)."""
    rules = {**engine_knob_rules(), **KNOB_APPLIES}  # an engine's own knobs: models/dp_engines.py
    for name in sorted(given):
        rule = rules.get(name)
        if rule is not None and not rule[0](setup):
            raise ConfigError(name, f"only applies with {rule[1]}; this setup never reads it (dp_engine "
                                    f"{setup.dp_engine}, zero_stage {setup.zero_stage}, checkpointing "
                                    f"{setup.checkpointing}, optimizer_offload {setup.optimizer_offload}, "
                                    f"checkpoint_every {setup.checkpoint_every}): drop it or change what it needs")


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained.

    precision:
      fp32           everything fp32.
      bf16-mixed     16-bit parameters and gradients, fp32 master weights and optimizer states
      fp16-mixed     (DeepSpeed / Megatron style; `fp32_grads` keeps gradients in fp32).
      bf16-autocast  torch.autocast: fp32 parameters, gradients and states, 16-bit activations and
      fp16-autocast  16-bit weight copies cached for the forward pass.
      bf16           pure bf16: parameters, gradients and states all bf16.
    """

    micro_batch: int = 1
    seq_len: int = 1024
    grad_accum: int = 1
    steps: int = 2
    precision: str = "fp32"
    fp32_grads: bool = False
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    set_to_none: bool = True
    frozen: tuple[str, ...] = ()  # fnmatch patterns over parameter names
    world_size: int = 1
    zero_stage: int = 0
    checkpointing: str = "none"  # activation checkpointing policy: see CHECKPOINTING and models/tape.py
    checkpoint_every_k: int = 2  # checkpointing "every-k": layers 0, k, 2k, ... are checkpointed
    checkpoint_layers: tuple[int, ...] = ()  # checkpointing "layers": exactly these layers are checkpointed
    logits_held: bool = True  # the caller keeps `logits` alive until backward ends
    passes: str = "train"  # "train": forward, loss, backward, step; "forward": `out = model(batch)` only, see PASSES
    moe_routing: str | None = None  # experts only (models/moe.py): "balanced" (None), "worst" or "counts:PATH"
    # data parallelism (models/parallel/): which engine shards what, and its knobs
    dp_engine: str = "deepspeed"
    reshard_after_forward: bool = True  # fsdp2: free a unit's unsharded parameters after its forward
    forward_prefetch: int = 0  # fsdp2: units all-gathered ahead of the one running, in forward
    backward_prefetch: int = 1  # fsdp2: likewise in backward (FSDP2's default implicit prefetch is 1)
    reduce_dtype: str = "grad"  # fsdp2: MixedPrecisionPolicy.reduce_dtype, see REDUCE_DTYPES
    ddp_bucket_cap_mb: int = 25  # ddp / zero-redundancy-optimizer: DDP gradient bucket size (MiB)
    reduce_bucket_size: int = 500_000_000  # deepspeed: elements per gradient reduce bucket
    allgather_bucket_size: int = 500_000_000  # deepspeed stages 1-2: elements per parameter all-gather
    stage3_prefetch_bucket_size: int = 50_000_000  # deepspeed stage 3: elements fetched ahead
    stage3_max_live_parameters: int = 1_000_000_000  # deepspeed stage 3: gathered elements kept at most
    stage3_param_persistence_threshold: int = 100_000  # deepspeed stage 3: smaller parameters stay whole
    # training checkpoints (models/checkpoint_io.py): saved after every N-th optimizer step, loaded at the start
    checkpoint_every: int = 0  # save after every N-th optimizer step (0 = never)
    save_mode: str = "torch-save"  # how a save is made: see SAVE_MODES
    load_mode: str = "none"  # how the run starts from a checkpoint: see LOAD_MODES ("none": fresh)
    build: str = "direct"  # how the parameters reach the device: see BUILDS
    # optimizer-state offload (models/optimizers.py): the states live in host memory between steps
    optimizer_offload: str = "none"  # see OPTIMIZER_OFFLOADS
    offload_chunk_params: int = 100_000_000  # chunked: parameter elements whose states move and update together
    offload_prefetch: int = 1  # chunked: chunks copied to the device ahead of the one being updated
    offload_first_step: str = "whole"  # chunked: step 1 as one torch step() ("whole") or chunk by chunk
    # LoRA / QLoRA (models/lora.py): peft adapters on the named linears, the whole base model frozen
    lora_r: int = 0  # adapter rank (0 = no LoRA)
    lora_alpha: float = 8.0  # scaling = lora_alpha / lora_r (peft's LoraConfig default 8)
    lora_dropout: float = 0.0  # dropout on the adapters' input (0: nn.Identity, nothing saved)
    lora_targets: tuple[str, ...] = ()  # peft target_modules; () = peft's default for the model family
    quantize: str = "none"  # base linears: "none" or "nf4" (bitsandbytes Linear4bit, double quant: QLoRA)
    # model parallelism: world_size = dp x tp x pp x cp (`_model_parallel_fields`), each simulated on the device
    # mesh (models/parallel/mesh.py); models/parallel/checks.py names the combinations that are not
    pp: int = 1  # pipeline-parallel ranks (one stage each, `virtual_stages` each when interleaved)
    pp_schedule: str = "1f1b"  # see PP_SCHEDULES; grad_accum is the number of micro-batches of a step
    virtual_stages: int = 1  # stages per pipeline rank: interleaved-1f1b >= 2, zbv exactly 2, else 1
    tp: int = 1  # tensor-parallel ranks
    cp: int = 1  # context-parallel ranks
    ep: int = 1  # expert-parallel ranks (a mixture-of-experts model; borrowed from dp x cp)
    sequence_parallel: bool = False  # Megatron-style sequence parallelism (needs tp > 1)

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        _positive_int(self, "micro_batch", "seq_len", "grad_accum", "steps", "world_size")
        _at_most(self, "grad_accum", "world_size")
        _choice(self, "precision", PRECISIONS)
        _choice(self, "optimizer", OPTIMIZERS)
        _choice(self, "optimizer_impl", OPTIMIZER_IMPLS)
        _choice(self, "checkpointing", CHECKPOINTING)
        _positive_int(self, "checkpoint_every_k")
        _checkpoint_layers(self)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("zero_stage", f"unknown value {self.zero_stage!r}; allowed: 0, 1, 2, 3")
        _choice(self, "dp_engine", tuple(DP_ENGINE_REGISTRY))
        if self.zero_stage and self.dp_engine != "deepspeed":
            raise ConfigError("zero_stage", f"ZeRO stages are DeepSpeed's (dp_engine deepspeed); {self.dp_engine} "
                                            "shards by itself: fsdp2 = parameters, gradients and states "
                                            "(reshard_after_forward false: like stage 2), "
                                            "zero-redundancy-optimizer = states (like stage 1), ddp = none")
        _positive_int(self, "ddp_bucket_cap_mb", "reduce_bucket_size", "allgather_bucket_size",
                      "stage3_prefetch_bucket_size", "stage3_max_live_parameters")
        for name in ("forward_prefetch", "backward_prefetch", "stage3_param_persistence_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, f"must be an integer >= 0, got {value!r}")
        _choice(self, "reduce_dtype", REDUCE_DTYPES)
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError("reshard_after_forward", f"must be true or false, got {self.reshard_after_forward!r}")
        if self.fp32_grads and not self.prec.mixed:
            raise ConfigError("fp32_grads", "only applies to bf16-mixed or fp16-mixed precision")
        _checkpoint_io_fields(self)
        _optimizer_offload_fields(self)
        if self.moe_routing is not None and not (self.moe_routing in ("balanced", "worst")
                                                 or self.moe_routing.startswith("counts:") and self.moe_routing[7:]):
            raise ConfigError("moe_routing", f"unknown value {self.moe_routing!r}; allowed: balanced, worst, "
                                             "counts:PATH (a peakledger-moe-counts JSON file)")
        _lora_fields(self)
        _model_parallel_fields(self)
        _build_field(self)
        _choice(self, "passes", PASSES)
        if self.passes == "forward":
            for name, ok, allowed in (("world_size", self.world_size == 1, "1"),
                                      ("grad_accum", self.grad_accum == 1, "1"),
                                      ("checkpoint_every", self.checkpoint_every == 0, "0"),
                                      ("optimizer_offload", self.optimizer_offload == "none", "none")):
                if not ok:
                    raise ConfigError(name, f"passes \"forward\" runs forward passes on one device without an "
                                            f"optimizer: {name} must be {allowed}")

    @property
    def prec(self) -> Precision:
        """`precision` decoded (models/precision.py): each kind of tensor's dtype, and autocast's."""
        return PRECISION_TABLE[self.precision]

    @property
    def param_dtype(self) -> str:
        return PRECISION_TABLE[self.precision].param

    @property
    def compute_dtype(self) -> str:
        """The dtype of activations."""
        return PRECISION_TABLE[self.precision].compute

    @property
    def grad_dtype(self) -> str:
        return "fp32" if self.fp32_grads else self.param_dtype

    @property
    def master_dtype(self) -> str | None:
        """fp32 master weights exist only in the mixed-precision modes."""
        return PRECISION_TABLE[self.precision].master

    @property
    def state_dtype(self) -> str:
        return PRECISION_TABLE[self.precision].state

    @property
    def dp(self) -> int:
        """Data-parallel ranks: world_size / (tp x pp x cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def effective_batch(self) -> int:
        """B_eff = micro-batch x accumulation x data-parallel degree (world_size without tp, pp, cp)."""
        return self.micro_batch * self.grad_accum * self.dp


__all__ = ["ConfigError", "TransformerConfig", "MLPConfig", "TrainingSetup", "dtype_bytes", "dtype_name",
           "IMPLEMENTATIONS", "GPT2_ACTIVATIONS", "PRECISIONS", "OPTIMIZERS", "OPTIMIZER_IMPLS", "CHECKPOINTING",
           "DP_ENGINES", "OPTIMIZER_OFFLOADS", "OFFLOAD_FIRST_STEPS", "QUANTIZE", "PP_SCHEDULES", "BUILDS"]
