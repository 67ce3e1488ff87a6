"""What a compute plan needs to know of a model (`ModelShape`): its parameters (all, and those one token runs
through), its embedding tables, and the widths the attention and vocabulary-head FLOPs scale with.

`model_shape(model, seq_len)` reads it from a model as every other command resolves it (`--preset`, `--hf-config`):
- a hand-written transformer (`TransformerConfig`): its parameter list (models/transformer/params.py), the experts
  a token is not routed to left out of the active count (models/moe.py `active_params`);
- a traced HF causal LM (`TracedModel`): the model transformers builds on the meta device (models/catalog
  `meta_model`: no memory), its nn.Embedding tables and an untied output head; a mixture of experts by its config's
  expert counts (`num_local_experts` / `num_experts` / `n_routed_experts` and `num_experts_per_tok`), the parameters
  under `.experts.` scaled by top-k / experts.
Anything else (an MLP, a --module, an encoder or image model) has no tokens to plan: refused, naming --params.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError, TransformerConfig
from .families import family_of
from .moe import active_params
from .traced.model import TracedModel, hf_task
from .transformer.params import transformer_params

TABLES = ("transformer.wte.weight", "transformer.wpe.weight", "model.embed_tokens.weight", "lm_head.weight")
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes for its training FLOPs. `n_embedding`: the embedding tables (token, position) and an untied
    output head, which Kaplan et al.'s N leaves out (the lookups do no matmul; the head's matmul is the vocabulary
    term); `seq_len`: the context the attention term is counted at."""

    name: str
    source: str  # how the counts were read, in words
    n_params: int  # all parameters, tied ones once
    n_active: int  # those one token runs through (a mixture of experts: top-k of them); = n_params when dense
    n_embedding: int
    n_layer: int
    d_model: int
    d_attn: int  # all query heads together: n_head x head_dim
    vocab_size: int
    seq_len: int
    experts: str | None = None  # "top-2 of 8 experts"

    @property
    def n_non_embedding(self) -> int:
        """Kaplan et al.'s N: the active parameters less the embedding tables and an untied head."""
        return self.n_active - self.n_embedding


def model_shape(model, seq_len: int) -> ModelShape:
    if family_of(model).transformer:
        return _hand_written(model, seq_len)
    if isinstance(model, TracedModel) and model.kind == "hf":
        return _traced(model, seq_len)
    what = "a --module model" if isinstance(model, TracedModel) else f"{getattr(model, 'name', model)!r}, not a decoder"
    raise ConfigError("preset", f"plan counts a decoder's training tokens, and {what} has none to count: give its "
                                "parameter count with --params (e.g. --params 124M)")


def _hand_written(cfg: TransformerConfig, seq_len: int) -> ModelShape:
    params = transformer_params(cfg)
    total = sum(p.numel for p in params)
    tables = sum(p.numel for p in params if p.name in TABLES)
    experts = cfg.num_local_experts is not None
    return ModelShape(name=cfg.name, source="the hand-written preset's parameter list (models/transformer/params.py)",
                      n_params=total, n_active=active_params(cfg, total) if experts else total, n_embedding=tables,
                      n_layer=cfg.n_layer, d_model=cfg.d_model, d_attn=cfg.attn_dim, vocab_size=cfg.vocab_size,
                      seq_len=seq_len,
                      experts=f"top-{cfg.num_experts_per_tok} of {cfg.num_local_experts} experts" if experts else None)


def _config_int(config, names: tuple[str, ...], what: str, model: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ConfigError("hf_config", f"{model}'s config has no {what} ({' / '.join(names)}) to count its attention and "
                                   "vocabulary FLOPs with: give its parameter count with --params instead")


def _traced(model: TracedModel, seq_len: int) -> ModelShape:
    task = hf_task(model.hf_dict())[1]
    if task != "AutoModelForCausalLM":
        raise ConfigError("hf_config", f"plan counts a decoder's training tokens, and {model.name} trains as "
                                       f"{task.removeprefix('AutoModelFor')}, not a causal LM: give its parameter "
                                       "count with --params")
    import torch

    from .catalog import meta_model

    built = meta_model(model)
    config = built.config
    total = sum(p.numel() for p in built.parameters())
    tables = {id(m.weight): m.weight.numel() for m in built.modules() if isinstance(m, torch.nn.Embedding)}
    head = built.get_output_embeddings()
    if head is not None and id(head.weight) not in tables:  # an untied output head: the vocabulary term's matmul
        tables[id(head.weight)] = head.weight.numel()
    n_layer = _config_int(config, ("num_hidden_layers", "n_layer"), "layer count", model.name)
    d_model = _config_int(config, ("hidden_size", "n_embd"), "hidden size", model.name)
    heads = _config_int(config, ("num_attention_heads", "n_head"), "head count", model.name)
    head_dim = getattr(config, "head_dim", None)
    head_dim = head_dim if isinstance(head_dim, int) and head_dim > 0 else d_model // heads
    vocab = _config_int(config, ("vocab_size",), "vocabulary size", model.name)
    active, experts = total, None
    count = next((getattr(config, k) for k in EXPERT_COUNT_KEYS if isinstance(getattr(config, k, None), int)), None)
    in_experts = sum(p.numel() for n, p in built.named_parameters() if ".experts." in f".{n}")
    if in_experts and count:
        k = _config_int(config, ("num_experts_per_tok",), "experts per token", model.name)
        active = total - in_experts + in_experts * k // count
        experts = f"top-{k} of {count} experts"
    elif in_experts:
        raise ConfigError("hf_config", f"{model.name} has experts and its config no expert count "
                                       f"({' / '.join(EXPERT_COUNT_KEYS)}): give --params and --active-params")
    return ModelShape(name=model.name, source="transformers' model built on the meta device from its config.json",
                      n_params=total, n_active=active, n_embedding=sum(tables.values()), n_layer=n_layer,
                      d_model=d_model, d_attn=heads * head_dim, vocab_size=vocab, seq_len=seq_len, experts=experts)


__all__ = ["ModelShape", "model_shape"]
