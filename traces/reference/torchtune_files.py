"""torchtune's own source files, loaded one at a time: torchtune 0.6.1's package `__init__` imports a torchao older than
the one beside torch 2.13 (`torchao.dtypes.nf4tensor` moved), so the reference programs load the single files they
run (its CEWithChunkedOutputLoss, its OffloadActivations) straight from the installed package's folder."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path


def torchtune_root() -> Path | None:
    """The installed torchtune package's folder, or None without torchtune (never imported)."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def load_file(name: str, path: Path) -> types.ModuleType:
    """The Python file at `path` executed as a module named `name` (not entered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


__all__ = ["torchtune_root", "load_file"]
