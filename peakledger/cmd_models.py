"""`peakledger models`: the models `--preset` (and `--hf-config`) take by name.

    peakledger models            # the bundled config.json files: name, hub id, model type, parameters, source
    peakledger models --json

The bundled files are models/catalog's; each one's parameters are those of the model transformers builds from it
(on the meta device: no memory). The hand-written presets follow, by name.
"""

from __future__ import annotations

import os

from .cli_common import write_json
from .models.catalog import CATALOG, hub_cache_dir, parameters, traced_model
from .models.presets import PRESETS
from .models.transformer.hf_config import read_hf_json


def catalog_rows() -> list[dict]:
    """One row per bundled model, in the catalog's order."""
    return [{"name": m.name, "hub_id": m.hub_id, "model_type": read_hf_json(m.path).get("model_type"),
             "parameters": parameters(traced_model(m)), "source": m.source} for m in CATALOG]


def render(rows: list[dict], hub_cache: str) -> str:
    cols = ("name", "hub id", "type", "parameters", "source of the config.json")
    cells = [(r["name"], r["hub_id"], str(r["model_type"]), f"{r['parameters'] / 1e9:.2f} B", r["source"])
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda row: "  ".join(c.rjust(w) if i == 3 else c.ljust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return "\n".join([f"{len(rows)} bundled models (config.json only; --preset NAME or --preset HUB-ID):", "",
                      line(cols), *(line(r) for r in cells), "",
                      f"hand-written presets (--preset NAME): {', '.join(PRESETS)}",
                      f"a hub id not bundled is read from the local hub cache, {hub_cache} (offline: nothing is "
                      "downloaded)"])


def cmd_models(args) -> int:
    rows = catalog_rows()
    cache = str(hub_cache_dir(os.environ))
    if args.json:
        write_json({"models": rows, "presets": list(PRESETS), "hub_cache": cache})
    else:
        print(render(rows, cache))
    return 0


def register(sub) -> None:
    """Adds the `models` sub-command."""
    p = sub.add_parser("models", help="list the models --preset takes by name: current open models' bundled "
                                      "config.json files (parameters, hub id, source) and the hand-written presets")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_models, unit=None)
