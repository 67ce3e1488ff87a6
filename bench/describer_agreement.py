"""Where the hand-written describers give the program transformers runs: the describer-agreement matrix.

    python bench/describer_agreement.py [--write] [--device cpu|H100-80GB]

For HF configs of the families the hand-written describers read (GPT-2, Llama, Mixtral), every combination of
precision (fp32, bf16, bf16 autocast, bf16-mixed) x LoRA (off, r 4 on the attention projections) x activation
checkpointing (none, full) x data parallelism (one rank, FSDP2 on 2 ranks, ZeRO-3 on 2 ranks) x attention
implementation (eager, sdpa) is simulated through both describers (`--describer hand-written` and `--describer
traced`) and through the default (`auto`). A cell agrees when the two peaks are equal to the byte. The default
path must give the traced describer's peak in every cell (it routes HF configs to the traced describer:
peakledger/scenario.py); the table says where the hand-written describer is the same program and by how much it
differs where it is not. tests/test_describer_agreement.py asserts the routing on a subset.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
from sections import replace_section  # bench/sections.py, beside this script  # noqa: E402

from peakledger import api  # noqa: E402
from peakledger.models.config import ConfigError  # noqa: E402
from peakledger.scenario import build_scenario  # noqa: E402

SECTION = "## Describer agreement: hand-written against traced on HF configs"
ROOT = BENCH.parent
FAMILIES = {"gpt2": "hf-gpt2-tiny", "llama": "hf-llama-tiny", "mixtral": "hf-mixtral-tiny"}
PRECISIONS = ("fp32", "bf16", "bf16-autocast", "bf16-mixed")
LORA = ({}, {"lora_r": 4, "lora_alpha": 8})
CHECKPOINTING = ("none", "full")
PARALLEL = ({}, {"dp_engine": "fsdp2", "world_size": 2}, {"dp_engine": "deepspeed", "zero_stage": 3, "world_size": 2})
ATTENTION = ("eager", "sdpa")


def cells():
    for family, precision, lora, ckpt, par, attn in itertools.product(FAMILIES, PRECISIONS, LORA, CHECKPOINTING,
                                                                       PARALLEL, ATTENTION):
        yield family, precision, lora, ckpt, par, attn


def label(family, precision, lora, ckpt, par, attn) -> str:
    dp = ("1 rank" if not par else f"tp x {par['world_size']}" if "dp_engine" not in par
          else f"FSDP2 x {par['world_size']}" if par["dp_engine"] == "fsdp2" else f"ZeRO-3 x {par['world_size']}")
    return f"{family}, {precision}, {'LoRA' if lora else 'full FT'}, ckpt {ckpt}, {dp}, {attn}"


def peak(config: Path, describer: str, training: dict, device: str) -> int | str:
    try:
        scenario = build_scenario({"hf_config": str(config), "describer": describer}, training, {"device": device})
        return api.run(scenario).peaks.overall.bytes
    except ConfigError as e:
        return f"refused ({e.field})"


def cell(workdir: Path, family, precision, lora, ckpt, par, attn, device: str) -> dict:
    data = json.loads((ROOT / "examples" / FAMILIES[family] / "config.json").read_text())
    data["attn_implementation"] = attn
    path = workdir / f"{family}-{attn}.json"
    path.write_text(json.dumps(data))
    training = {"micro_batch": 2, "seq_len": 32, "steps": 2, "precision": precision, "checkpointing": ckpt,
                **par, **({**lora, "lora_targets": ["c_attn"] if family == "gpt2" else ["q_proj", "v_proj"]}
                          if lora else {})}
    out = {"cell": label(family, precision, lora, ckpt, par, attn)}
    for describer in ("hand-written", "traced", "auto"):
        out[describer] = peak(path, describer, training, device)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for c in cells():
            r = cell(Path(tmp), *c, device=args.device)
            rows.append(r)
            print(r, flush=True)
    seconds = time.perf_counter() - t0
    both = [r for r in rows if isinstance(r["hand-written"], int) and isinstance(r["traced"], int)]
    agree = [r for r in both if r["hand-written"] == r["traced"]]
    routed = sum(r["auto"] == r["traced"] for r in rows)
    summary = (f"{len(rows)} cells on the {args.device} profile: the default path gives the traced describer's "
               f"answer in {routed}/{len(rows)}; both describers simulate {len(both)}, equal to the byte in "
               f"{len(agree)}")
    print(summary)
    if args.write:
        lines = ["| cell | hand-written (B) | traced (B) | hand-written error | default |", "|---|---|---|---|---|"]
        for r in rows:
            h, t = r["hand-written"], r["traced"]
            err = f"{h / t - 1:+.3%}" if isinstance(h, int) and isinstance(t, int) else "-"
            fmt = lambda v: f"{v:,}" if isinstance(v, int) else v  # noqa: E731
            lines.append(f"| {r['cell']} | {fmt(h)} | {fmt(t)} | {err} | "
                         f"{'traced' if r['auto'] == t else fmt(r['auto'])} |")
        replace_section(SECTION, "\n".join([
            SECTION, "", f"`python bench/describer_agreement.py --write` ({seconds:.0f} s). " + __doc__.split("\n\n")[2]
            .replace("\n", " ") + f" **{summary}.**", "", *lines, ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
