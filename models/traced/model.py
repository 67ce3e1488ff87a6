"""`TracedModel`: a model peakledger does not describe by hand, given as a HF config or a user's factory,
and built on demand: on fake tensors to be traced, or for real (random weights, CPU) to be measured.

The two sources (`kind`):
- "hf": a transformers config.json. The class is the config's `architectures[0]` when transformers has
  it, else the first auto class (causal LM, masked LM, seq2seq LM, image classification, speech
  seq2seq) that maps the model type. The default batch (`batch_note` says it in words):
    text:   input_ids and labels, micro-batch x seq-len, random token ids;
    image:  pixel_values of the config's image_size and num_channels, and one label per image;
    speech: input_features of num_mel_bins x 2*max_source_positions frames (Whisper: 30 s of audio,
            the feature extractor's fixed 3000 frames) and labels of seq-len tokens;
    audio (CTC, audio classification): input_values of seq-len frames of raw audio (Wav2Vec2, HuBERT,
            WavLM: seq-len x the conv strides' product samples), or a max_length x num_mel_bins spectrogram
            (Audio Spectrogram Transformer); CTC labels of seq-len / 4 token ids, else one label each.
  The loss is the model's own (`output.loss`). Weights are not initialised (transformers'
  `no_init_weights`): they do not change the program, and some initialisers (ViT's trunc_normal_)
  read values fake tensors do not have. The batches are made by hf_batch.py.
- "module": `path/to/file.py:factory`; `factory()` returns `(model, batch, loss_fn)`: an nn.Module in fp32
  on the CPU, a batch (dict -> `model(**batch)`, tuple -> `model(*batch)`, tensor -> `model(batch)`), and
  `loss_fn(output)` returning a scalar. If the factory takes `micro_batch` and/or `seq_len` keyword
  arguments, they are passed; otherwise those knobs cannot be varied (`varies`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import COUNT_LIMITS, INT64_MAX, ConfigError, TrainingSetup
from . import store
from .boundary import REAL_BYTES, user_code
from .hf_batch import AUDIO_TASKS, CONTRASTIVE, ctc_label_len, hf_batch, pixels_note, stride_product

HF_TASKS = ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM",
            "AutoModelForImageClassification", "AutoModelForSpeechSeq2Seq", "AutoModelForCTC",
            "AutoModelForAudioClassification")


@dataclass(frozen=True)
class TracedModel:
    name: str
    kind: str  # "hf" or "module"
    source: str  # kind hf: the config as canonical JSON; kind module: "path.py:factory"
    digest: str  # sha256 of the config JSON or of the module file's bytes (the trace cache's key)
    varies: tuple[str, ...] = ("micro_batch", "seq_len")  # knobs the model's batch follows
    defaults: tuple[tuple[str, int], ...] = ()  # a factory's own defaults for them

    @property
    def max_seq_len(self) -> int | None:
        if self.kind != "hf":
            return None
        data = json.loads(self.source)
        for key in ("max_position_embeddings", "n_positions", "max_target_positions"):
            if isinstance(data.get(key), int):
                return data[key]
        return None

    def batch_defaults(self) -> dict:
        """Micro-batch and sequence length when the user sets none: a factory's own defaults for the ones it
        takes; for a HF text model a sequence of min(its maximum positions, 1024)."""
        if self.kind == "module":
            return dict(self.defaults)
        return {"seq_len": min(self.max_seq_len or 1024, 1024)}

    def hf_dict(self) -> dict:
        return json.loads(self.source)

    # -- building ------------------------------------------------------------------------------------
    def build(self, setup: TrainingSetup):
        """(model, batch, loss_fn) built under whatever mode is active (a FakeTensorMode, or none: real)."""
        if self.kind == "hf":
            return _hf_build(self.hf_dict(), setup)
        return _module_build(self.source, setup, self.varies)

    def batch_note(self, setup: TrainingSetup) -> str:
        if self.kind == "module":
            given = [k for k in ("micro_batch", "seq_len") if k in self.varies]
            return (f"the factory's batch ({', '.join(f'{k}={setup.knob(k)}' for k in given)} passed)" if given
                    else "the factory's batch (fixed: the factory takes no micro_batch / seq_len)")
        task = hf_task_name(self.hf_dict(), self.digest)[1]
        data = self.hf_dict()
        B, T = setup.batch.micro_batch, setup.batch.seq_len
        if task == "AutoModelForImageClassification":
            vision = data if "image_size" in data else data.get("vision_config") or {}
            return f"{pixels_note(vision, B)} and {B} labels"
        if task == "AutoModelForSpeechSeq2Seq":
            frames = 2 * data.get("max_source_positions", 1500)
            return f"input_features {B}x{data.get('num_mel_bins', 80)}x{frames} (30 s of audio) and labels {B}x{T}"
        if task in AUDIO_TASKS:
            labels = f"labels {B}x{ctc_label_len(T)}" if task == "AutoModelForCTC" else f"{B} labels"
            if "conv_stride" in data:
                samples = T * stride_product(data["conv_stride"])
                return f"input_values {B}x{samples} ({T} frames of raw audio) and {labels}"
            return f"input_values {B}x{data.get('max_length', 1024)}x{data.get('num_mel_bins', 128)} and {labels}"
        if task == CONTRASTIVE:
            return f"input_ids {B}x{T} and {pixels_note(data.get('vision_config') or {}, B)} (the contrastive loss " \
                   "between them)"
        return f"input_ids and labels {B}x{T} (random token ids)"


def from_hf_dict(data: dict, name: str) -> TracedModel:
    text = json.dumps(data, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    hf_task_name(data, digest)  # refuses a model type transformers does not know
    check_hf_sizes(data)
    return TracedModel(name=name, kind="hf", source=text, digest=digest)


def hf_task_name(data: dict, digest: str) -> tuple[str, str]:
    """(model class name, auto class) of a HF config (`digest`: of its canonical JSON): from the disk cache where
    this transformers took the config before (store.py; transformers is not imported), else from `hf_task`."""
    known = store.known_task(digest)
    if known is not None:
        return known
    cls, task = hf_task(data)
    store.remember_task(digest, cls.__name__, task)
    return cls.__name__, task


def from_module_spec(spec: str) -> TracedModel:
    """`path/to/file.py:factory`, checked: the file exists and defines `factory` (it is imported here)."""
    path, factory = _split_spec(spec)
    fn = _load_factory(path, factory)
    params = inspect.signature(fn).parameters
    varies = tuple(k for k in ("micro_batch", "seq_len") if k in params)
    defaults = tuple((k, params[k].default) for k in varies if isinstance(params[k].default, int)
                     and not isinstance(params[k].default, bool))
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return TracedModel(name=f"{Path(path).stem}:{factory}", kind="module", source=f"{path}:{factory}",
                       digest=digest, varies=varies, defaults=defaults)


# -- HF --------------------------------------------------------------------------------------------------

# config keys that count modules transformers builds one by one (layers, experts): bounded as the hand-written
# describers bound n_layer (models/config.py COUNT_LIMITS), so no config makes unbounded work
HF_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers",
                 "decoder_layers", "num_local_experts", "num_experts", "n_routed_experts")


# config keys that are sizes every model of theirs needs at least one of (a vocabulary of 0 tokens makes no batch)
HF_SIZE_KEYS = ("vocab_size", "hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head",
                "num_key_value_heads", "head_dim", "intermediate_size", "num_hidden_layers", "n_layer", "num_layers",
                "max_position_embeddings", "n_positions")


def check_hf_sizes(data: dict, where: str = "hf_config") -> None:
    """Every integer of the config fits torch's int64 sizes, the sizes (HF_SIZE_KEYS) given as integers are at
    least 1, and the module counts are within COUNT_LIMITS."""
    limit, why = COUNT_LIMITS["n_layer"]
    for key, value in data.items():
        if isinstance(value, dict):
            check_hf_sizes(value, f"{where}.{key}")
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT64_MAX:
                raise ConfigError(f"{where}.{key}", f"{v:,} is over 2^63 - 1, the largest size torch can hold (int64)")
        if key in HF_SIZE_KEYS and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{where}.{key}", f"must be a positive integer (a size), got {value}")
        if key in HF_COUNT_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise ConfigError(f"{where}.{key}", f"{value:,} is over the limit of {limit:,} ({why})")


def hf_task(data: dict):
    """(model class, auto class name) for a config dict, or a ConfigError naming what is wrong."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        raise ConfigError("hf_config", "tracing a HF config runs transformers, which is not installed: "
                                       "pip install 'peakledger[hf]'") from None

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        known = ", ".join(sorted(CONFIG_MAPPING.keys())[:12])
        raise ConfigError("model_type", f"{model_type!r} is not a model type transformers "
                                        f"{transformers.__version__} knows (e.g. {known}, ...)")
    config_cls = CONFIG_MAPPING[model_type]
    for arch in data.get("architectures") or ():
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if cls is not None:
            return cls, _task_of(cls, config_cls)
    tasks = list(HF_TASKS)
    if not data.get("is_decoder", False):  # an encoder with both heads (BERT, RoBERTa) trains as a masked LM
        masked = transformers.AutoModelForMaskedLM._model_mapping
        if config_cls in masked and config_cls in transformers.AutoModelForCausalLM._model_mapping:
            tasks.remove("AutoModelForMaskedLM")
            tasks.insert(0, "AutoModelForMaskedLM")
    for task in tasks:
        auto = getattr(transformers, task)
        if config_cls in auto._model_mapping:
            return _first(auto._model_mapping[config_cls]), task
    raise ConfigError("model_type", f"{model_type!r} has no training head peakledger can feed (allowed tasks: "
                                    f"{', '.join(HF_TASKS)}); give `architectures` in the config")


def _task_of(cls, config_cls) -> str:
    import transformers
    for task in HF_TASKS:
        mapping = getattr(transformers, task)._model_mapping
        if config_cls in mapping and cls in _classes(mapping[config_cls]):
            return task
    params = inspect.signature(cls.forward).parameters
    if {"input_ids", "pixel_values", "return_loss"} <= set(params):  # CLIP-like: text and image towers
        return CONTRASTIVE
    return "AutoModelForCausalLM"


# a model of a text and an image tower trained by its contrastive loss (modeling_clip.py CLIPModel.forward:
# `return_loss=True` gives `clip_loss` of the logits between each text and image of the batch)


def _classes(entry) -> tuple:
    """An auto mapping's entry: one class, or several (DeiT: the classifier and the one with a distillation
    teacher), as `transformers.models.auto.auto_factory._get_model_class` reads it."""
    return tuple(entry) if isinstance(entry, (list, tuple)) else (entry,)


def _first(entry):
    """The class transformers' auto class builds for a config without `architectures`: the entry's first
    (auto_factory.py `_get_model_class`)."""
    return _classes(entry)[0]


def hf_config(data: dict, **changes):
    """transformers' config object of a config dict (its model type's config class), with `changes` over its keys,
    or a ConfigError naming the field transformers refused."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    hf_task(data)  # a model type transformers knows, else the ConfigError saying so
    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    try:
        return CONFIG_MAPPING[data["model_type"]](**{**kwargs, **changes})
    except Exception as e:  # TypeError, ValueError, huggingface_hub's strict-dataclass validation errors
        field = getattr(e, "field", None)  # huggingface_hub's StrictDataclassFieldValidationError names it
        raise ConfigError(f"hf_config.{field}" if isinstance(field, str) else "hf_config",
                          f"transformers refused the config: {' '.join(str(e).split())}") from None


def _hf_build(data: dict, setup: TrainingSetup):
    import torch
    from transformers.initialization import no_init_weights

    cls, task = hf_task(data)
    # transformers drops the cache when layers are checkpointed (transformers/modeling_layers.py
    # GradientCheckpointingLayer)
    config = hf_config(data, **({"use_cache": False} if setup.checkpointing.policy != "none" else {}))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision.param, torch.float32)
    from .realpath import build_values
    try:
        with no_init_weights(), build_values():  # values computed from the config (drop-path rates) are real
            model = cls._from_config(config, dtype=dtype)
        model.tie_weights()  # post_init ties them only when it initialises (transformers/modeling_utils.py)
    except Exception as e:  # transformers' own checks on the config (a pad_token_id outside the vocabulary...)
        raise ConfigError("hf_config", f"transformers could not build {cls.__name__} from it: "
                                       f"{type(e).__name__}: {e}") from None
    if setup.lora.r:
        model = _peft_lora(model, setup)
    model.train()
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():  # the batch has real values (token ids a trace's branches may read)
        return model, hf_batch(config, task, setup, dtype), _hf_loss


def _peft_lora(model, setup: TrainingSetup):
    """peft's LoRA on the HF model, as `get_peft_model(model, LoraConfig(...))` makes it (the base frozen, the
    adapters trainable); targets () take peft's default for the model type. Its moves of fake adapters go through
    `fake_module_moves`."""
    if setup.lora.quantize != "none":
        raise ConfigError("quantize", "QLoRA is modelled on the hand-written describers (--preset, or --describer "
                                      "hand-written for GPT-2 / Llama-family configs); a traced model takes LoRA only")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("lora_r", "LoRA on a traced model runs peft: pip install 'peakledger[lora]'") from None
    config = LoraConfig(r=setup.lora.r, lora_alpha=setup.lora.alpha, lora_dropout=setup.lora.dropout,
                        target_modules=list(setup.lora.targets) or None)
    try:
        with fake_module_moves():
            return get_peft_model(model, config)
    except ValueError as e:  # peft: no module matches the targets, or no default for this model type
        raise ConfigError("lora_targets", f"peft refused them: {e}") from None


class fake_module_moves:
    """While active: `Module.to(...)` on a module of fake tensors that changes no device returns the module as it
    is, cast by hand (`_cast`) where it changes the dtype: under FakeTensorMode torch's `Module._apply` swaps
    each parameter in place (`torch.utils.swap_tensors`), which fake tensors refuse ("Couldn't swap"). peft
    moves every adapter so, and a factory may cast its model; real modules are moved as usual."""

    def __enter__(self):
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        self.original = to = torch.nn.Module.to

        def fake_aware_to(module, *args, **kwargs):
            tensors = list(module.parameters()) + list(module.buffers())
            if not any(isinstance(t, FakeTensor) for t in tensors):
                return to(module, *args, **kwargs)
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            if all(device is None or t.device == device for t in tensors):
                if dtype is not None:
                    _cast(module, dtype)
                return module
            return to(module, *args, **kwargs)

        torch.nn.Module.to = fake_aware_to
        return self

    def __exit__(self, *exc):
        import torch
        torch.nn.Module.to = self.original
        return False


def _hf_loss(output):
    return output.loss


# -- user modules -----------------------------------------------------------------------------------------

def _split_spec(spec: str) -> tuple[str, str]:
    path, sep, factory = str(spec).rpartition(":")
    if not sep or not path or not factory.isidentifier():
        raise ConfigError("module", f"{spec!r} is not PATH.py:FACTORY (a Python file and a function name in it)")
    p = Path(path)
    if not p.is_file():
        raise ConfigError("module", f"{path}: no such file")
    return str(p), factory


def _load_factory(path: str, factory: str):
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    name = f"peakledger_user_{Path(path).stem}_{digest}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError("module", f"{path}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        try:
            with user_code(f"importing {path}", real_bytes=REAL_BYTES):
                spec.loader.exec_module(module)
        except ConfigError:
            raise
        except Exception as e:  # the user's code: any error is theirs, named
            raise ConfigError("module", f"importing {path} failed: {type(e).__name__}: {e}") from None
        sys.modules[name] = module
    fn = getattr(module, factory, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == name)
        raise ConfigError("module", f"{path} defines no function {factory!r} (functions there: "
                                    f"{', '.join(defined) or 'none'})")
    return fn


def _module_build(spec: str, setup: TrainingSetup, varies: tuple[str, ...]):
    import torch

    path, factory = _split_spec(spec)
    fn = _load_factory(path, factory)
    kwargs = {k: setup.knob(k) for k in varies}
    call = f"{factory}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    from .realpath import build_values, fake_mode_active
    try:
        # under the fake mode (a trace) its real memory is measured; a real run (validate) builds it for real.
        # A factory may move or cast its model (peft does) while it is fake; values it computes from
        # constants (drop-path rates) are real.
        real_bytes = REAL_BYTES if fake_mode_active() else 0
        with user_code(call, real_bytes=real_bytes), fake_module_moves(), build_values():
            result = fn(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("module", f"{call} raised {type(e).__name__}: {e}") from None
    if not (isinstance(result, tuple) and len(result) == 3):
        got = f"a {len(result)}-tuple" if isinstance(result, tuple) else type(result).__name__
        raise ConfigError("module", f"{factory}() must return (model, batch, loss_fn); it returned {got}")
    model, batch, loss_fn = result
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("module", f"{factory}() returned {type(model).__name__} as the model; it must be a "
                                    "torch.nn.Module")
    if not (isinstance(batch, (dict, tuple, list, torch.Tensor))):
        raise ConfigError("module", f"{factory}() returned {type(batch).__name__} as the batch; allowed: dict "
                                    "(model(**batch)), tuple or list (model(*batch)), tensor (model(batch))")
    if not callable(loss_fn):
        raise ConfigError("module", f"{factory}() returned {type(loss_fn).__name__} as loss_fn; it must be "
                                    "callable: loss_fn(output) -> scalar tensor")
    if setup.precision.param != "fp32":
        _cast(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[setup.precision.param])
    model.train()
    return model, batch, loss_fn


def _cast(model, dtype) -> None:
    """`model.to(dtype)` for floating parameters and buffers, done by hand: under FakeTensorMode `Module.to`
    tries to swap tensors in place and fails. Shared (tied) tensors stay shared."""
    import torch

    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in done:
                    new = t.detach().to(dtype)
                    done[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else new
                table[key] = done[id(t)]
