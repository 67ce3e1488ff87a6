"""What every config shares: `ConfigError`, config files read safely, dtype names and sizes, and the small
checks (positive integers, bounded counts, one of a set of choices) the config classes are built from."""

from __future__ import annotations

from ...simulator.safe_io import InputError, digits_message, read_text, too_many_digits
from ...simulator.strict_json import JSONRefused
from ..names import did_you_mean

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int64": 8, "bool": 1, "int32": 4}
DTYPE_BYTES["fp8_e4m3"] = 1  # torchao AdamWFp8's codes (float8_e4m3fn): models/lowbit.py
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                 "uint8": "int8", "long": "int64"}


# float8 tensors (models/float8.py: torch.float8_e4m3fn / float8_e5m2), 1 byte; not a dtype a knob takes
FP8_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1}


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
    except JSONRefused as e:
        raise ConfigError(field_name, f"{path}: {e}") from None
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
    if size is None:
        size = FP8_DTYPE_BYTES.get(dtype)
    return size if size is not None else DTYPE_BYTES[dtype_name(dtype)]


INT64_MAX = 2**63 - 1  # torch sizes are int64 (c10::SymInt): no dimension, count or element number is larger


def non_negative_int(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(name, f"must be an integer >= 0, got {value!r}")


def positive_int(obj, *names: str) -> None:
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


def at_most(obj, *names: str) -> None:
    for name in names:
        limit, why = COUNT_LIMITS[name]
        value = getattr(obj, name)
        if isinstance(value, int) and value > limit:
            raise ConfigError(name, f"{value:,} is over the limit of {limit:,} ({why})")


def choice_of(obj, name: str, allowed, aliases: dict[str, str] | None = None) -> None:
    """`obj.<name>` is one of `allowed`, else a ConfigError listing them and saying the one meant, if any is close
    (models/names.py; `aliases` the list's other names for its values, suggested, never taken)."""
    value = getattr(obj, name)
    if value not in allowed:
        raise ConfigError(name, f"unknown value {value!r}; allowed: {', '.join(map(str, allowed))}"
                                f"{did_you_mean(value, allowed, aliases)}")

