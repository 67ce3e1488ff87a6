"""Named model configs: each family's presets (models/families/<name>/ `PRESETS`), by name.

Figures are the published architectures (layer count, widths, heads, vocabulary); weights are never
downloaded: describers need shapes only, and reference torch models are built with random weights. HF
`config.json` files are read by models/transformer/hf_config.py.
"""

from __future__ import annotations

from .config import ConfigError
from .families import FAMILIES

# the order the CLI has always listed them in; a family's other presets follow, in the registry's order
ORDER = ("tiny", "tiny-llama", "tiny-mlp", "gpt2", "gpt2-medium", "llama-3-8b", "llama-3-70b", "llama-3.1-405b",
         "mistral-7b", "mixtral-8x7b")
_ALL = [p for family in FAMILIES for p in family.presets]
PRESETS: dict = {p.name: p for p in sorted(_ALL, key=lambda p: ORDER.index(p.name) if p.name in ORDER else len(ORDER))}


def preset(name: str):
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("preset", f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}") from None
