"""The house's rules, read from the code's own imports (module level and inside functions alike): the layers import
downward only (simulator, models, traces, analysis, peakledger, lowest first), and no import cycle exists."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("simulator", "models", "traces", "analysis", "peakledger")


def _modules() -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for path in (REPO / layer).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    if name.startswith("peakledger.") and name.split(".")[1] in LAYERS[:4]:
        name = name.removeprefix("peakledger.")  # the folders install as peakledger's subpackages
    return name if name in modules else None


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports, named by folder (`from X import y`: X.y where that is a module,
    else X)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[str | None] = []
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - (node.level - 1)] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                found = [_resolve(f"{stem}.{a.name}", modules) or _resolve(stem, modules) for a in node.names]
            elif isinstance(node, ast.Import):
                found = [_resolve(a.name, modules) for a in node.names]
            graph[mod] |= {m for m in found if m is not None and m != mod}
    return graph


def test_layers_import_downward_only():
    graph = _imports(_modules())
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = sorted((m, t) for m, ts in graph.items() for t in ts if rank[t.split(".")[0]] > rank[m.split(".")[0]])
    assert upward == []


def test_no_import_cycle():
    graph = _imports(_modules())
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_every_package_folder_installs():
    """pyproject.toml's [tool.setuptools] `packages` names every folder with an __init__.py under the installed
    layers (an editable install finds a folder left out; a wheel does not ship it)."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"peakledger." + ".".join(p.parent.relative_to(REPO).parts).removeprefix("peakledger").lstrip(".")
               for layer in LAYERS for p in (REPO / layer).rglob("__init__.py")}
    assert folders - {"peakledger."} <= set(tool["packages"]) | {"peakledger"}, folders - set(tool["packages"])


def test_precision_sets_are_read_from_precision_objects():
    """A set of precisions is a property of `Precision` (models/precision.py: `uniform`, `mixed`, `autocast`), never
    a tuple of names written out where it is used (`setup.precision.name not in ("fp32", "bf16")`)."""
    import re

    pattern = re.compile(r"precision\s+(not\s+)?in\s+\(")
    found = sorted(f"{path.relative_to(REPO)}:{n}" for mod, path in _modules().items()
                   if path != REPO / "models" / "precision.py"
                   for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line))
    assert found == []


def test_precision_is_tested_by_its_fields_not_its_name():
    """`setup.precision` is a `Precision`: code asks what it means (`.mixed`, `.uniform`, `.param`), never compares
    its name with a string (`setup.precision.name == "bf16"`), outside models/precision.py and the checks of the
    knobs as the user wrote them (models/config/checks.py)."""
    import re

    pattern = re.compile(r"precision(\.name)?\s*(==|!=)\s*[\"']")
    allowed = {REPO / "models" / "precision.py", REPO / "models" / "config" / "checks.py"}
    found = sorted(f"{path.relative_to(REPO)}:{n}" for mod, path in _modules().items() if path not in allowed
                   for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line))
    assert found == []


def test_no_private_name_is_imported_across_modules():
    """A name one module gives another is public (no leading underscore): its owner says it is shared."""
    private = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("peakledger")):
                private += [f"{mod}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []
