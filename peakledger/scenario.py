"""A scenario: one model, one training setup, one device. From flags, a TOML file, or both.

TOML layout (every key optional; flags given on the command line override the file):

    [model]
    preset = "gpt2"          # or a bundled model, "qwen2.5-7b" / "Qwen/Qwen2.5-7B"; or hf_config = "config.json"
    n_layer = 6              # any field of the preset's config overrides it

    [training]               # any TrainingSetup field
    micro_batch = 8
    seq_len = 1024
    precision = "bf16-mixed"

    [run]
    device = "H100-80GB"
    headroom = 0.1
    alloc_conf = "expandable_segments:True"   # the CUDA caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF)
    empty_cache_before_save = false           # torch.cuda.empty_cache() before each checkpoint save
    torch_version = "2.13"                    # whose CUDA rules: 2.6, 2.11 or 2.13 (default: the installed torch's)
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .models.catalog import MODELS, hub_cache_dir, known_names, looks_like_hub_id, resolve
from .models.config import (
    COUNT_LIMITS,
    KNOBS,
    ConfigError,
    MLPConfig,
    TrainingSetup,
    TransformerConfig,
    check_given_knobs,
    read_config_file,
)
from .models.devices import DEVICES
from .models.families import family_of
from .models.fields import by_name, check_types, in_keys, keys_of
from .models.names import did_you_mean
from .models.presets import PRESETS, preset
from .models.traced.model import TracedModel, from_hf_dict, from_module_spec
from .models.transformer.hf_config import HAND_WRITTEN_HF, load_hf_config, read_hf_json
from .simulator.allocator import TORCH_VERSIONS, AllocatorConfig
from .simulator.engine import SIMULATORS
from .simulator.numbers import float_text, int_text
from .simulator.torch_rules import default_version

ModelConfig = TransformerConfig | MLPConfig | TracedModel  # (the families' configs: models/families/)
DEFAULT_PRESET = "gpt2"
RUN_FIELDS = ("device", "headroom", "alloc_conf", "empty_cache_before_save", "torch_version", "simulator")
DEFAULT_SETUP = dict(micro_batch=8, seq_len=1024, precision="bf16-mixed", optimizer="adamw")


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelConfig
    setup: TrainingSetup
    device: str = "H100-80GB"
    headroom: float = 0.0
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF syntax; "" = torch's defaults (simulator/allocator.py)
    empty_cache_before_save: bool = False  # the program calls torch.cuda.empty_cache() before each checkpoint save
    # whose CUDA rules apply (simulator/torch_rules); default: the installed torch's, else the nearest modelled
    torch_version: str = dataclasses.field(default_factory=default_version)
    simulator: str = "builtin"  # the discrete-event engine: simulator/engine.py's, or SimPy's (same log)

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        if self.torch_version not in TORCH_VERSIONS:
            close = did_you_mean(self.torch_version, TORCH_VERSIONS)
            raise ConfigError("torch_version", f"{self.torch_version!r} is not modelled; allowed: "
                                               f"{', '.join(TORCH_VERSIONS)}{close}")
        AllocatorConfig.parse(self.alloc_conf, self.torch_version)  # refuses what torch or the model does not take
        if self.simulator not in SIMULATORS:
            raise ConfigError("simulator", f"unknown value {self.simulator!r}; allowed: {', '.join(SIMULATORS)}"
                                           f"{did_you_mean(self.simulator, SIMULATORS)}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"unknown device {self.device!r}; allowed: {', '.join(DEVICES)}"
                                        f"{did_you_mean(self.device, DEVICES)}")
        if not isinstance(self.headroom, (int, float)) or isinstance(self.headroom, bool) or self.headroom < 0:
            raise ConfigError("headroom", f"must be a number >= 0 (0.1 = 10%), got {self.headroom!r}")

    def settings(self) -> set[str]:
        """Every name `with_changes` accepts: TrainingSetup fields, this model's fields (by key: models/fields.py),
        device, headroom, name."""
        return set(KNOBS) | set(keys_of(type(self.model))) | set(RUN_FIELDS) | {"name"}

    def with_changes(self, **changes) -> "Scenario":
        """Change setup fields, model fields or run fields by name (for comparisons and sweeps)."""
        setup_keys = set(KNOBS)
        model_keys = set(keys_of(type(self.model)))
        setup = {k: v for k, v in changes.items() if k in setup_keys}
        model = {k: v for k, v in changes.items() if k in model_keys and k not in setup_keys and k != "name"}
        run = {k: v for k, v in changes.items() if k in RUN_FIELDS + ("name",)}
        unknown = set(changes) - set(setup) - set(model) - set(run)
        if unknown:
            allowed = sorted(setup_keys | model_keys | set(RUN_FIELDS) | {"name"})
            key = sorted(unknown)[0]
            raise ConfigError(key, f"unknown setting; allowed: {', '.join(allowed)}{did_you_mean(key, allowed)}")
        new = dataclasses.replace(self, model=_replace(self.model, by_name(type(self.model), model)),
                                  setup=_replace(self.setup, setup), **run)
        if (
            new.setup.compile.on and not self.setup.compile.on
        ):  # compile as a fix (explain, checkpointing): a preset too
            new = dataclasses.replace(new, model=compiled_model(new.model))
        return new


def compiled_model(model: ModelConfig) -> ModelConfig:
    """The model torch.compile's program is made of: a traced model's, so a hand-written transformer runs as its HF
    equivalent (its family's `hf_equivalent`; a ConfigError where it has none); a traced model itself (and a model
    of no HF equivalent too, which compile then refuses)."""
    hf_equivalent = family_of(model).hf_equivalent
    if hf_equivalent is not None:
        return from_hf_dict(hf_equivalent(model), f"{model.name} (as its HF equivalent)")
    return model


def parse_value(text: str):
    """A command-line value (`--case`, `--grid`) typed the one way peakledger types them: an int, a float,
    true/false, else the string itself. The field it is given to checks the type strictly."""
    for read in (int_text, float_text):  # ASCII digits only (simulator/numbers.py)
        value = read(text)
        if value is not None:
            return value
    return {"true": True, "false": False}.get(text.lower(), text)


def _replace(obj, changes: dict):
    if not changes:
        return obj
    try:
        return obj.replace(**changes) if isinstance(obj, TrainingSetup) else dataclasses.replace(obj, **changes)
    except TypeError as e:
        raise ConfigError(next(iter(changes)), str(e)) from None


def lists_as_tuples(table: dict) -> dict:
    """TOML gives lists; the configs are frozen and hold tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


TABLES = ("model", "training", "run")


def load_toml(path: str | Path) -> dict:
    data = read_config_file(path, "scenario", tomllib.loads, tomllib.TOMLDecodeError, "TOML")
    unknown = set(data) - {*TABLES, "name"}
    if unknown:
        raise ConfigError(sorted(unknown)[0],
                          "unknown table in scenario file; allowed: [model], [training], [run], name")
    for table in TABLES:
        if table in data and not isinstance(data[table], dict):
            raise ConfigError(table, f"must be a table ([{table}] followed by key = value lines), got "
                                     f"{type(data[table]).__name__} {data[table]!r}")
    if "name" in data and not isinstance(data["name"], str):
        raise ConfigError("name", f"must be a string, got {data['name']!r}")
    return data


GPU_ONLY_RUN = ("alloc_conf", "torch_version", "empty_cache_before_save")  # read by the CUDA allocator model only
HEADROOM_LIMIT = 10.0  # capacity needed = peak x (1 + headroom): 10 = 1,000% is past any margin anyone keeps


def _check_given_run(run: dict) -> None:
    """Run settings the user gave that the setup would never read are refused, as models/config/applies.py
    KNOB_APPLIES does for training knobs; a headroom is a fraction of the peak, bounded."""
    if run.get("device") == "cpu":
        ignored = [k for k in GPU_ONLY_RUN if run.get(k) not in (None, "", False)]
        if ignored:
            raise ConfigError(ignored[0], "only applies on a GPU device profile (the CUDA caching allocator's "
                                          "rules); --device cpu never reads it: drop it or pick a GPU profile")
    headroom = run.get("headroom")
    finite = isinstance(headroom, (int, float)) and not isinstance(headroom, bool) and headroom < float("inf")
    if finite and headroom > HEADROOM_LIMIT:  # (not a number, or infinite: Scenario's own check says so)
        raise ConfigError("headroom", f"{headroom:g} is over the limit of {HEADROOM_LIMIT:g} (a fraction of the "
                                      "peak: 0.1 = 10%)")


def build_scenario(model_table: dict | None = None, training: dict | None = None, run: dict | None = None,
                   name: str | None = None, defaults: dict | None = None) -> Scenario:
    """A scenario from its three tables. `training` holds what the user set (each such field must apply to
    the setup: see models/config/applies.py KNOB_APPLIES); `defaults` are training values of the caller's own,
    taken where the user set nothing and where the model has the field (an MLP has no sequence)."""
    model_table = dict(model_table or {})
    training = lists_as_tuples(training or {})
    run = dict(run or {})
    _check_given_run(run)
    hf = model_table.pop("hf_config", None)
    preset_name = model_table.pop("preset", None)
    module = model_table.pop("module", None)
    describer = model_table.pop("describer", "auto")
    for key, value in (("hf_config", hf), ("preset", preset_name), ("module", module), ("describer", describer)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(key, f"must be a non-empty string, got {value!r}")
    sources = [k for k, v in (("preset", preset_name), ("hf_config", hf), ("module", module)) if v]
    if len(sources) > 1:
        raise ConfigError(sources[0], f"give one model source, not {' and '.join(sources)}")
    preset_name, hf, hf_name = named_model(preset_name, hf, hub_cache_dir(os.environ))
    if describer not in DESCRIBERS:
        raise ConfigError("describer", f"unknown value {describer!r}; allowed: {', '.join(DESCRIBERS)}"
                                       f"{did_you_mean(describer, DESCRIBERS)}")
    base = _traced_source(hf, module, describer, training, hf_name)
    if base is not None:
        return traced_scenario(base, model_table, training, run, name, defaults)
    if describer == "traced":
        raise ConfigError("describer", "traced applies to --hf-config and --module models; a preset or a model "
                                       "table is described by hand")
    if hf:
        base = load_hf_config(hf, hf_name)
    elif preset_name or not model_table:
        base = preset(preset_name or DEFAULT_PRESET)
    else:
        base = None
    model_keys = set(keys_of(type(base) if base else TransformerConfig))
    for key in model_table:
        if key not in model_keys:
            raise ConfigError(key, f"unknown model field; allowed: preset, hf_config, {', '.join(sorted(model_keys))}"
                                   f"{did_you_mean(key, sorted(model_keys))}")
    if base is None:
        try:
            model = TransformerConfig(**{"name": "custom", **by_name(TransformerConfig, lists_as_tuples(model_table))})
        except TypeError as e:
            raise ConfigError("model", f"a model without preset needs every TransformerConfig field: "
                                       f"{in_keys(TransformerConfig, str(e))}") from None
    else:
        model = _replace(base, by_name(type(base), lists_as_tuples(model_table)))
    family = family_of(model)
    if training.get("compile") is True and family.hf_equivalent is not None:
        return traced_scenario(compiled_model(model), {}, training, run, name or model.name, defaults)
    _check_training_keys(training)
    if family.seq_len is None and "seq_len" in training:
        raise ConfigError("seq_len", family.no_seq_len)
    base_setup = dict(DEFAULT_SETUP, seq_len=family.seq_len(model) if family.seq_len is not None else 1)
    base_setup.update({k: v for k, v in (defaults or {}).items() if k != "seq_len" or family.seq_len is not None})
    return _scenario(model, base_setup, training, run, name)


def _check_training_keys(training: dict) -> None:
    setup_keys = set(KNOBS)
    for key in training:
        if key not in setup_keys:
            raise ConfigError(key, f"unknown training field; allowed: {', '.join(sorted(setup_keys))}"
                                   f"{did_you_mean(key, sorted(setup_keys))}")


def _scenario(model, base_setup: dict, training: dict, run: dict, name) -> Scenario:
    """The scenario: the caller's base training values under the user's (each of which must apply), the run."""
    values = {**base_setup, **training}
    pp = values.get("pp", 1)
    if isinstance(pp, int) and 1 < pp <= COUNT_LIMITS["pp"][0] and "grad_accum" not in training:  # (a pp out
        # of range is refused by TrainingSetup for what it is, not as the grad_accum it would have become)
        # a pipeline's step is its micro-batches: by default pp of them, the fewest 1F1B (and one round of
        # interleaved 1F1B) runs; GPipe runs any number
        values["grad_accum"] = values["pp"]
    setup = TrainingSetup(**values)
    check_given_knobs(setup, set(training))
    for key in run:
        if key not in RUN_FIELDS:
            raise ConfigError(key, f"unknown run field; allowed: {', '.join(RUN_FIELDS)}"
                                   f"{did_you_mean(key, RUN_FIELDS)}")
    return Scenario(name=name or model.name, model=model, setup=setup, **run)


DESCRIBERS = ("auto", "traced", "hand-written")


def hand_written_only(training: dict) -> str | None:
    """What in a setup only the hand-written describers simulate (model parallelism, bitsandbytes 4-bit
    QLoRA), named; None if the traced describer takes it all."""
    for key in ("tp", "pp", "cp", "ep"):
        if training.get(key, 1) not in (1, None):
            return f"{key} > 1 (model parallelism is simulated on the hand-written describers)"
    if training.get("quantize", "none") not in ("none", None):
        return "quantize (QLoRA is simulated on the hand-written describers)"
    return None


def named_model(preset_name: str | None, hf: str | None, hub_cache: Path | None) -> tuple[str | None, str | None,
                                                                                         str | None]:
    """A model given by name: a `preset` that is no hand-written preset, or an `hf_config` that is no file, is a
    bundled config.json or the local hub cache's (models/catalog `resolve`); (preset, hf_config, the model's name,
    None: the file's). A name that is neither is refused, saying the closest names (models/names.py)."""
    if preset_name is not None and preset_name not in PRESETS:
        found = resolve(preset_name, hub_cache)
        if found is None:
            close = did_you_mean(preset_name, known_names(preset_name) if looks_like_hub_id(preset_name) else
                                 [*PRESETS, *MODELS])
            raise ConfigError("preset", f"unknown model {preset_name!r}; allowed: a preset ({', '.join(PRESETS)}), a "
                                        f"bundled model ({', '.join(MODELS)}; `peakledger models` lists them) or the "
                                        f"hub id of one, or of one in the hub cache {hub_cache}{close}")
        return None, str(found.path), found.name
    if hf is not None and not Path(hf).exists():
        found = resolve(hf, hub_cache)
        if found is not None:
            return preset_name, str(found.path), found.name
        if looks_like_hub_id(hf) or "/" not in hf and not hf.endswith(".json"):
            raise ConfigError("hf_config", f"{hf!r} is no file, no bundled model (`peakledger models` lists them) "
                                           f"and no hub id in the hub cache {hub_cache}"
                                           f"{did_you_mean(hf, known_names(hf))}")
    return preset_name, hf, None


def _traced_source(hf, module, describer: str, training: dict, name: str | None = None) -> TracedModel | None:
    """The traced model a source names, or None where the hand-written describers take it. A module is always
    traced. A HF config is traced (the program transformers runs, whatever its version: bench/VALIDATION.md "GPU
    prediction: HF training programs"), unless `describer` is "hand-written", or it is "auto" and the setup asks
    for what only the hand-written describers simulate (`hand_written_only`) of a model type they read."""
    if module:
        if describer == "hand-written":
            raise ConfigError("describer", "a --module model can only be traced; allowed: auto, traced")
        return from_module_spec(module)
    if not hf:
        return None
    data = read_hf_json(hf)
    if describer == "hand-written" or (describer == "auto" and data.get("model_type") in HAND_WRITTEN_HF
                                       and hand_written_only(training)):
        return None
    path = Path(hf)
    return from_hf_dict(data, name=name or (path.stem if path.stem != "config" else path.parent.name or "hf"))


def traced_scenario(model: TracedModel, model_table: dict, training: dict, run: dict, name, defaults) -> Scenario:
    if model_table:
        raise ConfigError(sorted(model_table)[0], "model fields change hand-written configs; a traced model is what "
                                                  "its config.json or factory builds: edit that instead")
    fixed = [k for k in ("micro_batch", "seq_len") if k in training and k not in model.varies]
    if fixed:
        raise ConfigError(fixed[0], f"{model.source.rsplit(':', 1)[-1]}() takes no {fixed[0]} argument, so the "
                                    f"batch it builds cannot change; add `{fixed[0]}` to the factory's parameters")
    _check_training_keys(training)
    base_setup = dict(DEFAULT_SETUP, **model.batch_defaults())
    base_setup.update({k: v for k, v in (defaults or {}).items() if k not in ("micro_batch", "seq_len")
                       or k in model.varies})
    return _scenario(model, base_setup, training, run, name)


__all__ = ["Scenario", "build_scenario", "load_toml", "PRESETS", "DESCRIBERS"]
