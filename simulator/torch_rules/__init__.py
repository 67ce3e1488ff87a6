"""Every torch release whose CUDA rules peakledger models, one module each (v2_6, v2_11, v2_13: a `TorchRules`
value, base.py), and the pick of one: `rules_for` (the release asked for, refused when not modelled), `nearest`
(the newest modelled not newer, for a trace recorded under another release), `default_rules` (the installed
torch's when modelled, else the nearest, with the reason the report prints). A new release is one module more
here and one entry in `RULES`."""

from __future__ import annotations

from importlib import metadata

from ..safe_io import InputError
from . import v2_6, v2_11, v2_13
from .base import TorchRules, default_note, major_minor, pick

RULES: tuple[TorchRules, ...] = (v2_6.RULES, v2_11.RULES, v2_13.RULES)  # oldest first
TORCH_VERSIONS: tuple[str, ...] = tuple(r.version for r in RULES)


class TorchVersionError(InputError):
    def __init__(self, message: str) -> None:
        super().__init__("torch_version", message)


def rules_for(version: str | None) -> TorchRules:
    """The rule set of `version` ("2.13", "2.13.0", "2.13.0+cu130"); a release not modelled is refused."""
    m = None
    try:
        m = major_minor(version)
    except InputError:
        pass
    found = next((r for r in RULES if r.key == m), None)
    if found is None:
        raise TorchVersionError(f"{version!r} is not modelled; allowed: {', '.join(TORCH_VERSIONS)} "
                                "(major.minor, a patch level is ignored)")
    return found


def nearest(version: str) -> TorchRules:
    """The rules that hold for a torch that ran (`version`): its own when modelled, else the newest modelled
    release not newer than it (the oldest for an older one)."""
    return pick(RULES, version)[0]


def installed_torch() -> str | None:
    """The installed torch's version, read from its package metadata (torch is not imported); None without one."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def default_rules(installed: str | None) -> tuple[TorchRules, str]:
    """The rules a run follows when no torch version is asked for, and why (base.py `default_note`)."""
    return default_note(RULES, installed)


def default_version() -> str:
    """The torch version a run follows when none is asked for: `default_rules` of the installed torch."""
    return default_rules(installed_torch())[0].version


def rules_note(version: str, installed: str | None) -> str:
    """Why a run follows `version`'s rules, for the report: the default's reason, or that it was asked for."""
    chosen, why = default_rules(installed)
    if chosen.version == version:
        return why
    return "asked for" + (f"; torch {installed.partition('+')[0]} is installed" if installed else "")


def rules_reason(version: str) -> str:
    """`rules_note` of `version` with the torch installed here."""
    return rules_note(version, installed_torch())


__all__ = ["RULES", "TORCH_VERSIONS", "TorchRules", "TorchVersionError", "rules_for", "nearest", "installed_torch",
           "default_rules", "default_version", "rules_note",
           "rules_reason"]
