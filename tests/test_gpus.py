"""How many GPUs (peakledger/gpus.py): `where --min-gpus`, and explain's fixes that shard over more GPUs or train
adapters (QLoRA).

The worked example is issue 37's: Llama-3-8B (the hand-written Llama describer), a full fine-tune in bf16 mixed
precision with AdamW, micro-batch 4 of 2048 tokens, on H100-80GB cards. One card needs about 180 GiB; the smallest
FSDP2 world that fits is found by `where --min-gpus`, and checked here with `simulate --check` (its fit check
on the card) at that size, which fits, and one GPU fewer, which does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from cli_run import cli, cli_json

from peakledger.gpus import FSDP2, TP, min_gpus
from peakledger.scenario import build_scenario

LLAMA_8B = ["--preset", "llama-3-8b", "--precision", "bf16-mixed", "--micro-batch", "4", "--seq-len", "2048"]
LORA_8B = ["--preset", "llama-3-8b", "--lora-r", "16", "--precision", "bf16", "--micro-batch", "1", "--seq-len",
           "2048"]


def simulate_check(args: list[str], world: int, engine: str = "fsdp2") -> dict:
    """`simulate --check` on the card at `world` GPUs: the fit check's own verdict (--json's `fit_check`)."""
    extra = ["--world-size", str(world), "--dp-engine", engine] if world > 1 else []
    if engine == "deepspeed" and world > 1:
        extra += ["--zero-stage", "3"]
    rc, out, err = cli("simulate", *args, *extra, "--device", "H100-80GB", "--check", "--json")
    check = json.loads(out)["fit_check"]
    assert rc == (0 if check["fits"] else 1), err
    return check


@pytest.fixture(scope="module")
def counts():
    return cli_json("where", *LLAMA_8B, "--devices", "H100-80GB", "--min-gpus", "--layouts", "fsdp2,zero3")


def test_min_gpus_is_checked_by_simulate_at_n_and_one_fewer(counts):
    (card,) = counts["cards"]
    assert card["device"] == "H100-80GB"
    for row, engine in zip(card["layouts"], ("fsdp2", "deepspeed")):
        n = row["min_gpus"]
        assert n is not None and n > 1 and row["below"]["gpus"] == n - 1
        at, below = simulate_check(LLAMA_8B, n, engine), simulate_check(LLAMA_8B, n - 1, engine)
        assert at["fits"] and not below["fits"]
        # the figures `where` prints are those simulate's fit check judged
        assert row["at"]["capacity_needed"] == at["capacity_needed"]
        assert row["at"]["margin_bytes"] == at["budget"] - at["capacity_needed"]
        assert row["at"]["fits_by_allocator_retry"] == at["fits_by_allocator_retry"]
    assert not simulate_check(LLAMA_8B, 1)["fits"]


def test_min_gpus_text_names_each_count_and_the_one_below(counts):
    rc, text, _ = cli("where", *LLAMA_8B, "--devices", "H100-80GB", "--min-gpus", "--layouts", "fsdp2")
    n = counts["cards"][0]["layouts"][0]["min_gpus"]
    assert rc == 0
    assert f"H100-80GB, FSDP2: {n} GPU(s) fit with" in text and f"; {n - 1} do not: short" in text


def test_explain_offers_fsdp2_over_the_computed_number_of_gpus(counts):
    """The 8B on one 80 GB card: explain's fixes shard over N GPUs, N the count `where --min-gpus` finds."""
    x = cli_json("explain", *LLAMA_8B, "--device", "H100-80GB")
    assert not x["fits"]
    by_name = {f["name"]: f for f in x["fixes"]}
    for layout, row in zip(("FSDP2", "ZeRO-3"), counts["cards"][0]["layouts"]):
        n = row["min_gpus"]
        fix = by_name[f"{layout} over {n} GPUs (1 -> {n})"]
        assert fix["fits"] and fix["capacity_needed"] == row["at"]["capacity_needed"]
        assert fix["changes"]["world_size"] == n
        assert f"{n - 1} GPUs do not fit" in fix["cost"]
    assert by_name["FSDP2 over {0} GPUs (1 -> {0})".format(counts["cards"][0]["layouts"][0]["min_gpus"])][
        "changes"] == {"world_size": counts["cards"][0]["layouts"][0]["min_gpus"], "dp_engine": "fsdp2"}


def test_lora_on_a_24gb_card_is_offered_qlora_which_where_finds_fitting():
    x = cli_json("explain", *LORA_8B, "--device", "RTX-4090-24GB")
    assert not x["fits"]
    (qlora,) = [f for f in x["fixes"] if f["name"].startswith("QLoRA")]
    assert qlora["fits"] and qlora["changes"] == {"quantize": "nf4"} and qlora["changes_training"]
    row = cli_json("where", *LORA_8B, "--quantize", "nf4", "--devices", "RTX-4090-24GB", "--no-max-batch")
    assert row["devices"][0]["fits"] and row["devices"][0]["capacity_needed"] == qlora["capacity_needed"]
    plain = cli_json("where", *LORA_8B, "--devices", "RTX-4090-24GB", "--no-max-batch")
    assert not plain["devices"][0]["fits"]


@dataclass(frozen=True)
class Seen:
    fits: bool
    n: int


def test_the_search_finds_the_smallest_size_in_few_simulations():
    """The search itself on a judge that fits from 37 GPUs up: the answer, the size below, and O(log N) tries."""
    scenario = build_scenario({"preset": "gpt2"}, {}, {})
    tried = []

    def judge(sc):
        tried.append(sc.setup.mesh.world_size)
        return Seen(sc.setup.mesh.world_size >= 37, sc.setup.mesh.world_size)

    count = min_gpus(scenario, FSDP2, judge, limit=1000)
    assert (count.n, count.at.n, count.below_n, count.below.n) == (37, 37, 36, 36)
    assert len(tried) <= 2 * 10 and len(set(tried)) == len(tried)
    none = min_gpus(scenario, FSDP2, lambda sc: Seen(False, sc.setup.mesh.world_size), limit=64)
    assert none.n is None and none.below_n == 64
    # tensor parallelism: only divisors of the heads, within a node (gpt2: 12 heads -> 1, 2, 3, 4, 6)
    sizes = []
    tp = min_gpus(scenario, TP, lambda sc: sizes.append(sc.setup.mesh.tp) or Seen(sc.setup.mesh.tp >= 5, 0))
    assert tp.n == 6 and tp.below_n == 4 and set(sizes) <= {1, 2, 3, 4, 6}


@pytest.mark.parametrize("argv, says", [
    (["--min-gpus", "--layouts", "fsdp"], "layouts: 'fsdp' is not a layout; allowed: fsdp2, zero3, tp"),
    (["--layouts", "tp"], "layouts: only goes with --min-gpus"),
    (["--min-gpus", "--max-gpus", "0"], "max_gpus: must be 1 to 4096, got 0"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says):
    rc, out, err = cli("where", "--preset", "tiny", "--devices", "T4-16GB", *argv)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err
