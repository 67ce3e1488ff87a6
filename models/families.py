"""The model families, in one registry: which family a model is (`family_of`), and how each is described.

A family is a kind of model the project knows how to describe: the traced describer takes any nn.Module (a HF
config or a user's factory, models/traced); the hand-written describers take HF's Mixtral (hf_mixtral.py), HF's
GPT-2 (transformer/hf_gpt2.py), nanoGPT's GPT-2 and Llama (transformer/nanogpt.py) and the MLP (transformer/mlp.py).
The first family that takes a model describes it. The measuring side builds each family's real program under the
same name (traces/reference/build.py `PROGRAMS`). Adding a family is its describer's module, one `Family(...)`
line here and, to validate it for real, one entry there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import ConfigError, MLPConfig, TrainingSetup, TransformerConfig
from .hf_mixtral import hf_mixtral_tape
from .moe import check_routing
from .tape import Tape
from .traced import traced_tape
from .traced.model import TracedModel
from .transformer import mlp_tape, transformer_tape

Cuda = tuple[tuple[int, int], str] | None  # (compute capability, torch version) of a GPU program, None on a CPU


@dataclass(frozen=True)
class Family:
    name: str
    takes: Callable[[object], bool]
    # (model, setup, cpu, expert-parallel rank, cuda) -> the forward tape
    tape: Callable[[object, TrainingSetup, bool, int, Cuda], Tape]
    hand_written: bool = True


def _transformer(model: TransformerConfig, setup: TrainingSetup) -> None:
    if setup.batch.seq_len > model.max_seq_len:
        raise ConfigError("seq_len", f"{setup.batch.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
    check_routing(model, setup)


def _mixtral(model, setup, cpu, ep_rank, cuda) -> Tape:
    _transformer(model, setup)
    return hf_mixtral_tape(model, setup, cpu, ep_rank)


def _hf_gpt2(model, setup, cpu, ep_rank, cuda) -> Tape:
    _transformer(model, setup)
    return transformer_tape(model, setup, cpu)  # checks the LoRA targets as for nanoGPT, then hf_gpt2_tape


def _nanogpt(model, setup, cpu, ep_rank, cuda) -> Tape:
    _transformer(model, setup)
    return transformer_tape(model, setup, cpu, cuda[1] if cuda else "2.6")


def _mlp(model, setup, cpu, ep_rank, cuda) -> Tape:
    check_routing(model, setup)
    return mlp_tape(model, setup, cpu)


FAMILIES: tuple[Family, ...] = (
    Family("traced", lambda m: isinstance(m, TracedModel),
           lambda m, setup, cpu, ep_rank, cuda: traced_tape(m, setup, cpu, cuda), hand_written=False),
    Family("mixtral", lambda m: isinstance(m, TransformerConfig) and bool(m.num_local_experts), _mixtral),
    Family("hf-gpt2", lambda m: isinstance(m, TransformerConfig) and m.implementation == "hf", _hf_gpt2),
    Family("nanogpt", lambda m: isinstance(m, TransformerConfig), _nanogpt),
    Family("mlp", lambda m: isinstance(m, MLPConfig), _mlp),
)


def family_of(model) -> Family:
    for family in FAMILIES:
        if family.takes(model):
            return family
    raise ConfigError("model", f"no describer takes a {type(model).__name__}; families: "
                               f"{', '.join(f.name for f in FAMILIES)}")
