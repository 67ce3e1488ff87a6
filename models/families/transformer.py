"""What the three transformer families (nanogpt, hf-gpt2, mixtral: one `TransformerConfig`, models/transformer/'s
describers) answer alike: the batch is token ids up to max_seq_len, the layers are the config's blocks, and a
compiled run runs the HF equivalent. Each home takes these and adds its own."""

from __future__ import annotations

import re

from ..config import ConfigError, TrainingSetup, TransformerConfig
from ..transformer.hf_config import hf_equivalent


def check_seq_len(model: TransformerConfig, setup: TrainingSetup) -> None:
    """The sequence fits the model's positions (the describers' check, and the real batch's: traces/reference)."""
    if setup.batch.seq_len > model.max_seq_len:
        raise ConfigError("seq_len", f"{setup.batch.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")


def layer_pattern(model: TransformerConfig, setup: TrainingSetup | None = None) -> tuple[re.Pattern, int]:
    """Block i's ops are named `<blocks>.<i>.` (`TransformerConfig.blocks`)."""
    return re.compile(rf"(?:^|\.){re.escape(model.blocks)}\.(\d+)\."), 1


TRANSFORMER = dict(  # the hooks every transformer home passes to its Family (models/families/base.py)
    config=TransformerConfig, transformer=True,
    layers=lambda model, setup=None: model.n_layer, layer_pattern=layer_pattern,
    seq_len=lambda model: min(model.max_seq_len, 1024),
    tokens=lambda model, setup: True,
    hf_equivalent=hf_equivalent,
)


__all__ = ["TRANSFORMER", "check_seq_len", "layer_pattern"]
