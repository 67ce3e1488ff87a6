"""Current open models by name: their config.json files as published on the Hugging Face hub (no weights, no
tokenizer), bundled in data/, and the local hub cache's for a hub id not bundled. Offline: nothing is downloaded.

A model is named by its hub id (`Qwen/Qwen2.5-7B`) or by its name, the id's part after the slash lower-cased
(`qwen2.5-7b`), both case-insensitive (`resolve`). A bundled file is data/<name>.json; `CATALOG` says where each
file's values were taken from (a public copy of the hub's file: the hub itself is not reachable here), with the key
`_name_or_path`, which transformers writes into a loaded config and the hub's files mostly lack, left out. The file
is read as any `--hf-config` is (models/transformer/hf_config.py, models/traced): what transformers builds from it.

The hub cache is huggingface_hub's layout (huggingface_hub/constants.py, file_download.py): the folder is
$HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; a model's
files are models--<org>--<name>/snapshots/<commit>/, the commit the one refs/main names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class CatalogModel:
    hub_id: str  # "Org/Name", as the hub spells it
    source: str  # the public copy its config.json's values were taken from

    @property
    def name(self) -> str:
        return self.hub_id.partition("/")[2].lower()

    @property
    def path(self) -> Path:
        return DATA / f"{self.name}.json"


# the sources, each a repository at a commit, a file, and the entry in it
_PROF = "github.com/citsjtu2020/LLM-Prof@8434c8d sglang/Model_Config.md, section {}"
_MLC = "github.com/mlc-ai/mlc-llm@79d603f python/mlc_llm/model/model_preset.py, MODEL_PRESETS[{!r}]"
_THUNDER = "github.com/kevinstephano/thunder_model_blocks@5c083b0 thunder_model_blocks/{}"

CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel("Qwen/Qwen2.5-3B", _PROF.format("Qwen2.5-3B")),
    CatalogModel("Qwen/Qwen2.5-7B", _PROF.format("Qwen2.5-7B")),
    CatalogModel("Qwen/Qwen2.5-14B", _PROF.format("Qwen2.5-14B")),
    CatalogModel("Qwen/Qwen2.5-32B", _PROF.format("Qwen2.5-32B")),
    CatalogModel("Qwen/Qwen3-0.6B", _MLC.format("qwen3_0.6b")),
    CatalogModel("Qwen/Qwen3-1.7B", _MLC.format("qwen3_1.7b")),
    CatalogModel("Qwen/Qwen3-4B", _PROF.format("Qwen3-4B")),
    CatalogModel("Qwen/Qwen3-8B", _PROF.format("Qwen3-8B")),
    CatalogModel("Qwen/Qwen3-14B", _PROF.format("Qwen3-14B")),
    CatalogModel("Qwen/Qwen3-32B", _PROF.format("Qwen3-32B")),
    CatalogModel("Qwen/Qwen3-30B-A3B", _PROF.format("Qwen3-30B-A3B")),
    CatalogModel("meta-llama/Llama-3.1-8B", _PROF.format("Llama-3.1-8B")),
    CatalogModel("meta-llama/Llama-3.1-70B-Instruct", _MLC.format("llama3_1_70b")),
    CatalogModel("meta-llama/Llama-3.2-1B-Instruct", _MLC.format("llama3_2_1b")),
    CatalogModel("meta-llama/Llama-3.2-3B", _PROF.format("Llama-3.2-3B")),
    CatalogModel("google/gemma-2-2b-it", _MLC.format("gemma2_2b")),
    CatalogModel("google/gemma-2-9b-it", _THUNDER.format("gemma2/gemma2_config.py")),
    CatalogModel("google/gemma-3-1b-it", _MLC.format("gemma3_1b_it")),
    CatalogModel("microsoft/Phi-3.5-mini-instruct", _MLC.format("phi-3_5")),
    CatalogModel("microsoft/Phi-4-mini-instruct", _MLC.format("phi-4")),
    CatalogModel("mistralai/Mistral-7B-v0.3", _MLC.format("mistral_7b_v03")),
    CatalogModel("mistralai/Mistral-Nemo-Base-2407", _THUNDER.format("mistral/mistral_config.py")),
    CatalogModel("mistralai/Mixtral-8x7B-v0.1", _MLC.format("Mixtral-8x7B-v0.1")),
    CatalogModel("HuggingFaceTB/SmolLM2-135M-Instruct", _MLC.format("smollm2_135m")),
    CatalogModel("HuggingFaceTB/SmolLM2-360M-Instruct", _MLC.format("smollm2_360m")),
)
MODELS: dict[str, CatalogModel] = {m.name: m for m in CATALOG}


@dataclass(frozen=True)
class Found:
    """A model a name resolved to: its config.json, the name the scenario takes, and where the file is from."""

    path: Path
    name: str
    where: str  # "bundled" or "hub cache"


def looks_like_hub_id(text: str) -> bool:
    """"Org/Name": one slash between two non-empty parts, not a .json file."""
    org, slash, name = text.partition("/")
    return bool(slash and org and name and "/" not in name and not text.endswith(".json"))


def resolve(text: str, hub_cache: Path | None) -> Found | None:
    """The model `text` names: a bundled one by name or hub id (case-insensitive), else, for a hub id, the local hub
    cache's config.json (`hub_cache`, None: not looked in); None when neither has it."""
    key = text.strip().lower()
    for m in CATALOG:
        if key in (m.name, m.hub_id.lower()):
            return Found(m.path, m.name, "bundled")
    if hub_cache is not None and looks_like_hub_id(text.strip()):
        path = cached_config(text.strip(), hub_cache)
        if path is not None:
            return Found(path, path.parents[2].name.split("--", 2)[2], "hub cache")  # (the hub's spelling)
    return None


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The hub cache folder `environ` (the process's environment) names, as huggingface_hub/constants.py reads it."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    base = Path(environ["XDG_CACHE_HOME"]).expanduser() if environ.get("XDG_CACHE_HOME") else \
        Path(environ.get("HOME", "~")).expanduser() / ".cache"
    return base / "huggingface" / "hub"


def cached_config(hub_id: str, hub_cache: Path) -> Path | None:
    """models--<org>--<name>/snapshots/<refs/main>/config.json in `hub_cache` (the folder's name matched without
    case), or the one snapshot's when no refs/main is there; None when the model, or its config.json, is not."""
    org, _, name = hub_id.partition("/")
    wanted = f"models--{org}--{name}".lower()
    try:
        folder = next((p for p in sorted(hub_cache.iterdir()) if p.name.lower() == wanted), None)
    except OSError:
        return None
    if folder is None:
        return None
    ref = folder / "refs" / "main"
    try:
        commits = [ref.read_text().strip()] if ref.is_file() else \
            [p.name for p in (folder / "snapshots").iterdir()]
    except OSError:
        return None
    if len(commits) != 1:
        return None
    path = folder / "snapshots" / commits[0] / "config.json"
    return path if path.is_file() else None


def known_names(text: str) -> list[str]:
    """What a name typed as `text` is compared with for a suggestion: hub ids for an "Org/Name", else names."""
    return [m.hub_id for m in CATALOG] if looks_like_hub_id(text) else list(MODELS)


def traced_model(model: CatalogModel):
    """`model`'s config.json as the traced describer's model (models/traced/model.py `TracedModel`)."""
    from ..traced.model import from_hf_dict
    from ..transformer.hf_config import read_hf_json

    return from_hf_dict(read_hf_json(model.path), model.name)


def meta_model(traced):
    """A traced HF model (`TracedModel`) as transformers builds it on the meta device (no memory), the way the traced
    describer builds it (`TracedModel.build`): its modules and parameters, no values."""
    import torch
    from transformers.utils import logging as hf_logging

    from ..config import TrainingSetup

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # (its notes on a config's rope keys: not the listing's business)
    try:
        with torch.device("meta"):
            return traced.build(TrainingSetup())[0]
    finally:
        hf_logging.set_verbosity(verbosity)


def parameters(traced) -> int:
    """The parameters a traced HF model (`TracedModel`) holds, tied ones once (`meta_model`'s)."""
    return sum(p.numel() for p in meta_model(traced).parameters())


__all__ = ["CATALOG", "MODELS", "CatalogModel", "Found", "resolve", "hub_cache_dir", "cached_config",
           "looks_like_hub_id", "known_names", "traced_model", "parameters", "meta_model"]
