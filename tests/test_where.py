"""`peakledger where`: a scenario on every GPU device profile, and the profiles themselves.

The worked example: a Llama-3.2-1B-shaped model (HF LlamaForCausalLM's program, the hand-written Llama describer:
16 layers, d_model 2048, 32 heads / 8 KV heads, d_ff 8192, vocabulary 128,256), sequence 2048, micro-batch 1:
a full fine-tune (bf16 mixed precision, AdamW) fits the 40 GB cards and up, not a 24 GB card; a LoRA
(r 16 on q/k/v/o, pure bf16) fits every card. Each verdict is checked against `simulate --budget` on that profile
(the OOM the allocator replay records, or none), each largest micro-batch at its boundary (simulate at mb and mb + 1)
and against `peakledger max-batch`, and each profile's memory against the table of reports in bench/SOURCES.md.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from cli_run import cli, cli_json
from tables import cell_equals, decimals

from peakledger.cli import main
from peakledger.models.devices import DEVICES
from peakledger.where import GPU_PROFILES, gpu_profiles

ROOT = Path(__file__).resolve().parents[1]

# The total the CUDA driver reports per board (cudaMemGetInfo / deviceQuery's bytes / torch's total_memory), as the
# reports quoted in bench/SOURCES.md print it: (bytes, compute capability, bf16 tensor cores)
DRIVER_TOTALS = {
    "T4-16GB": (15_642_329_088, (7, 5), False),
    "V100-16GB": (16_928_342_016, (7, 0), False),
    "L4-24GB": (23_612_293_120, (8, 9), True),
    "A10G-24GB": (22_587 << 20, (8, 6), True),  # torch prints whole MiB
    "RTX-4090-24GB": (25_386_352_640, (8, 9), True),
    "RTX-3090-24GB": (25_447_170_048, (8, 6), True),
    "V100-32GB": (34_089_926_656, (7, 0), False),
    "A100-40GB": (42_298_834_944, (8, 0), True),
    "L40S-48GB": (47_576_711_168, (8, 9), True),
    "RTX-A6000-48GB": (51_160_023_040, (8, 6), True),
    "H100-PCIe-80GB": (81_008 << 20, (9, 0), True),
    "H100-80GB": (85_017_755_648, (9, 0), True),
    "A100-80GB": (85_100_068_864, (8, 0), True),
    "H200-141GB": (150_109_880_320, (9, 0), True),  # measured: ../shared/gpu-truth/h200
}
BY_MEMORY = sorted(DRIVER_TOTALS, key=lambda n: (DRIVER_TOTALS[n][0], n))

LLAMA_1B = ["--preset", "tiny-llama", "--n-layer", "16", "--d-model", "2048", "--n-head", "32", "--n-kv-head", "8",
            "--d-ff", "8192", "--vocab-size", "128256", "--max-seq-len", "4096", "--seq-len", "2048",
            "--micro-batch", "1"]
FULL = LLAMA_1B + ["--precision", "bf16-mixed", "--optimizer", "adamw", "--torch-version", "2.6"]
LORA = LLAMA_1B + ["--precision", "bf16", "--lora-r", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
                   "--torch-version", "2.6"]
FULL_FITS = ["A100-40GB", "L40S-48GB", "RTX-A6000-48GB", "H100-PCIe-80GB", "H100-80GB", "A100-80GB", "H200-141GB"]


def simulate_fits(args: list[str], device: str, micro_batch: int | None = None) -> bool:
    """Independently of where.py: `simulate --budget <the profile's memory>` records no OOM."""
    if micro_batch is not None:  # (in place of the args' own: a flag is given once)
        at = args.index("--micro-batch")
        args = [*args[:at], "--micro-batch", str(micro_batch), *args[at + 2:]]
    d = cli_json("simulate", *args, "--device", device, "--budget", str(DRIVER_TOTALS[device][0]))
    return not d["ooms"]


@pytest.fixture(scope="module")
def full():
    return cli_json("where", *FULL)


@pytest.fixture(scope="module")
def lora():
    return cli_json("where", *LORA)


# -- the device table ------------------------------------------------------------------------------------------

def test_every_gpu_profile_has_the_driver_reported_total_and_its_capabilities():
    assert set(GPU_PROFILES) == set(DRIVER_TOTALS)
    for name, (total, cc, bf16) in DRIVER_TOTALS.items():
        p = DEVICES[name]
        assert (p.memory_bytes, p.compute_capability, p.bf16_native) == (total, cc, bf16), name
        marketing = int(re.fullmatch(r".*-(\d+)GB", name).group(1))
        assert 0.9 * marketing * 10**9 < p.memory_bytes < marketing << 30  # below the board's GiB, never GB rounding
        assert p.is_cuda and p.context_bytes == 512 << 20 and p.flops["fp16"] > p.flops["fp32"]
        assert ("bf16" in p.flops) == bf16 and ("tf32" in p.flops) == bf16  # Volta / Turing: neither
    assert [p.name for p in gpu_profiles()] == BY_MEMORY


def test_sources_md_names_every_profile_with_its_bytes():
    text = (ROOT / "bench" / "SOURCES.md").read_text()
    section = text[text.index("## GPU device profiles"):]
    for name, (total, _, _) in DRIVER_TOTALS.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert int(cells[2].replace(",", "")) == total, name
        assert abs(total / 2**20 - int(cells[3].replace(",", ""))) < 1, name  # the MiB the report printed
        assert cells[4], name  # where it was read
        assert name in section.split("**Throughput**")[1], name  # and its FLOP/s' source


def test_bf16_without_tensor_cores_is_said_in_the_report():
    d = cli_json("simulate", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--precision", "bf16-mixed",
                 "--device", "T4-16GB")
    assert any("T4-16GB: no bf16 tensor cores (sm75)" in a for a in d["assumptions"])
    d = cli_json("simulate", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--device", "L4-24GB")
    assert not any("bf16 tensor cores" in a for a in d["assumptions"])


# -- the worked example: a full fine-tune vs a LoRA of a Llama-3.2-1B-shaped model ------------------------------

def test_full_fine_tune_fits_the_40gb_cards_and_up(full):
    rows = {r["device"]: r for r in full["devices"]}
    assert [r["device"] for r in full["devices"]] == BY_MEMORY
    assert full["fits_on"] == FULL_FITS
    for name, r in rows.items():
        assert r["usable_bytes"] == DRIVER_TOTALS[name][0]
        assert r["device_total_peak"] == r["outside_allocator"] + r["reserved_peak"] > r["allocated_peak"]
        assert r["capacity_needed"] == r["device_total_peak"]  # no headroom
        assert r["margin_bytes"] == r["usable_bytes"] - r["capacity_needed"]
        assert r["fits"] == (r["margin_bytes"] >= 0)  # (no allocator-retry rescue here)
        assert r["fits"] == simulate_fits(FULL, name), name
    # AdamW's bf16-mixed state alone is 16 bytes a parameter (~22 GiB): on the 24 GB cards it fits, one sample not
    assert [n for n, r in rows.items() if r["max_micro_batch"] == 0] == ["RTX-4090-24GB", "RTX-3090-24GB",
                                                                        "V100-32GB"]
    assert all(rows[n]["max_micro_batch"] == -1 for n in ("T4-16GB", "V100-16GB", "L4-24GB", "A10G-24GB"))
    assert all(rows[n]["max_micro_batch"] >= 1 for n in FULL_FITS)


def test_lora_fits_every_card(lora, full):
    assert lora["fits_on"] == BY_MEMORY
    rows = {r["device"]: r for r in lora["devices"]}
    for name, r in rows.items():
        assert r["fits"] and simulate_fits(LORA, name), name
        assert r["device_total_peak"] < {x["device"]: x for x in full["devices"]}[name]["device_total_peak"]
    # same rules (compute capability, assumed context), more memory: never a smaller batch
    for a, b in (("RTX-4090-24GB", "L40S-48GB"), ("RTX-3090-24GB", "RTX-A6000-48GB"), ("A100-40GB", "A100-80GB")):
        assert rows[a]["max_micro_batch"] <= rows[b]["max_micro_batch"]


@pytest.mark.parametrize("case, device", [("lora", "RTX-4090-24GB"), ("lora", "T4-16GB"), ("lora", "A100-80GB"),
                                          ("full", "A100-40GB"), ("full", "RTX-3090-24GB")])
def test_largest_micro_batch_is_the_boundary_simulate_finds(case, device, full, lora):
    args = {"full": FULL, "lora": LORA}[case]
    row = next(r for r in {"full": full, "lora": lora}[case]["devices"] if r["device"] == device)
    best = row["max_micro_batch"]
    assert best >= 0 and not row["search_limit_reached"]
    if best >= 1:
        assert simulate_fits(args, device, best)
    assert not simulate_fits(args, device, best + 1)
    d = cli_json("max-batch", *args, "--device", device, "--budget", str(DRIVER_TOTALS[device][0]))
    assert d["max_micro_batch"] == best


def test_text_table_and_check(full):
    rc, out, err = cli("where", *FULL, "--devices", "RTX-4090-24GB,A100-40GB", "--unit", "GiB")
    assert rc == 0 and err == ""  # no progress line: stderr is not a terminal
    lines = out.splitlines()
    assert lines[0] == "tiny-llama: micro-batch 1, bf16-mixed, torch 2.6 CUDA rules; sizes in GiB"
    assert lines[2].split() == ["device", "usable", "allocated", "reserved", "outside", "device", "total", "fits",
                                "margin", "max", "mb"]
    assert lines[3].startswith("RTX-4090-24GB") and " no " in lines[3]
    assert lines[4].startswith("A100-40GB") and " yes " in lines[4]
    rows = {r["device"]: r for r in full["devices"]}
    keys = ("usable_bytes", "allocated_peak", "reserved_peak", "outside_allocator", "device_total_peak")
    places = set()
    for line in lines[3:5]:  # every size a number in GiB (one unit, one number of decimals), the --json bytes
        cells = line.split()
        r = rows[cells[0]]
        assert all(cell_equals(c, r[k], "GiB") for c, k in zip(cells[1:6], keys)), line
        assert cell_equals(cells[7], r["margin_bytes"], "GiB"), line
        places |= {decimals(c) for c in cells[1:6] + [cells[7]]}
    assert len(places) == 1
    assert "fits on 1 of 2: A100-40GB" in out
    assert cli("where", *FULL, "--devices", "RTX-4090-24GB,A100-40GB")[1] == out  # same input, same output
    rc, _, _ = cli("where", *FULL, "--devices", "RTX-4090-24GB,L4-24GB,T4-16GB", "--no-max-batch", "--check")
    assert rc == 1  # fits nowhere
    rc, out, _ = cli("where", *LORA, "--devices", "T4-16GB,V100-16GB", "--no-max-batch", "--check")
    assert rc == 0 and "fits on 2 of 2" in out and "max mb" in out


def test_notes_say_what_a_profile_cannot_show(lora):
    notes = {r["device"]: r["notes"] for r in lora["devices"]}
    for name in ("T4-16GB", "V100-16GB", "V100-32GB"):  # bf16 emulated, and no flash attention there
        assert any(n.startswith("bf16: no bf16 tensor cores") for n in notes[name]), name
        assert any(n.startswith("attention: the hand-written describer writes the flash") for n in notes[name]), name
    assert all(not notes[n] for n in BY_MEMORY if not n.startswith(("T4", "V100")))
    assert [r["device"] for r in lora["devices"] if not r["exact"]] == ["T4-16GB", "V100-16GB", "V100-32GB"]
    for version, written in (("2.13", "cudnn"), ("2.6", "flash")):  # the note judges under the run's own torch
        d = cli_json("where", *LLAMA_1B, "--precision", "fp16-mixed", "--devices", "T4-16GB", "--no-max-batch",
                     "--torch-version", version)
        assert not any(n.startswith("bf16") for n in d["devices"][0]["notes"])  # fp16 is native there
        note = d["devices"][0]["notes"][0]
        assert note.startswith(f"attention: the hand-written describer writes the {written} SDPA kernel (sm90's "
                               f"choice under torch {version})"), note  # 2.13's cuDNN on sm90 in 16-bit
        assert f"torch {version} picks math on sm75" in note  # no flash before sm80; efficient: no GQA


def test_a_traced_hf_config_is_traced_for_each_gpu():
    d = cli_json("where", "--hf-config", str(ROOT / "examples" / "hf-llama-tiny" / "config.json"), "--seq-len", "32",
                 "--micro-batch", "2", "--precision", "bf16", "--devices", "T4-16GB,A100-80GB", "--no-max-batch")
    t4, a100 = d["devices"]
    assert (t4["device"], a100["device"]) == ("T4-16GB", "A100-80GB") and t4["fits"] and a100["fits"]
    assert t4["max_micro_batch"] is None  # not searched
    assert [n.split(":")[0] for n in t4["notes"]] == ["bf16"]  # the trace follows sm75's attention: no note
    assert t4["exact"] and a100["exact"]
    for row in (t4, a100):  # the row is what simulate reports on that profile
        sim = cli_json("simulate", "--hf-config", str(ROOT / "examples" / "hf-llama-tiny" / "config.json"),
                       "--seq-len", "32", "--micro-batch", "2", "--precision", "bf16", "--device", row["device"])
        assert sim["device_total_peak"]["bytes"] == row["device_total_peak"]
        assert sim["reserved_peak"]["bytes"] == row["reserved_peak"]


def test_a_module_with_a_fixed_batch_has_no_largest_micro_batch():
    d = cli_json("where", "--module", str(ROOT / "tests" / "traced_factories.py") + ":fixed", "--precision", "fp32",
                 "--devices", "L4-24GB")
    (row,) = d["devices"]
    assert row["fits"] and row["max_micro_batch"] is None and not row["max_micro_batch_searched"]
    assert row["notes"] == ["max micro-batch: the module's batch is fixed (its factory takes no micro_batch)"]


def test_progress_only_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err, out = Terminal(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)
    assert main(["where", "--preset", "tiny", "--devices", "T4-16GB,L4-24GB", "--no-max-batch"]) == 0
    shown = err.getvalue()
    assert "simulating on" in shown  # rich's bar on stderr (peakledger/progress.py), taken down at the end
    assert "simulating" not in out.getvalue() and out.getvalue().startswith("tiny: micro-batch")


# -- bad input: one line, exit 2 -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["--devices", "RTX-5090"], "devices: 'RTX-5090' is not a device profile; allowed: A100-80GB, H100-80GB"),
    (["--devices", "cpu"], "devices: 'cpu' is not a GPU profile; allowed:"),
    (["--devices", "T4-16GB,,L4-24GB"], "devices: expected comma-separated GPU profiles"),
    (["--devices", "T4-16GB,T4-16GB"], "devices: 'T4-16GB' is given twice"),
    (["--device", "T4-16GB"], "device: where simulates on every GPU profile in turn; choose some with --devices"),
    (["--precision", "fp8"], "precision"),
    (["--devices"], "expected one argument"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says):
    rc, out, err = cli("where", "--preset", "tiny", *argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err


def test_a_fit_by_flush_and_retry_is_one_verdict_with_its_warning():
    """Issue 37's L40S case: Llama-3-8B, FSDP2 x 8, seq 4096 needs 45.35 GiB unbounded on a 44.31 GiB card, and
    fits only because the allocator frees its cache and retries. The row prints the run on the card (the numbers
    judged), its margin, the flush and a thin-margin warning; `simulate --budget` agrees there is no OOM, and
    `simulate`'s unbounded device total is the one the row quotes for a larger card."""
    args = ["--preset", "llama-3-8b", "--dp-engine", "fsdp2", "--world-size", "8", "--seq-len", "4096",
            "--micro-batch", "1", "--torch-version", "2.6"]  # 2.6's composite RMSNorm: the case of issue 37
    row = cli_json("where", *args, "--devices", "L40S-48GB", "--no-max-batch")["devices"][0]
    usable = DRIVER_TOTALS["L40S-48GB"][0]
    assert row["fits"] and row["fits_by_allocator_retry"] and row["alloc_retries"] >= 1
    assert row["device_total_peak"] == row["capacity_needed"] <= usable
    assert row["margin_bytes"] == usable - row["device_total_peak"] >= 0
    unbounded = cli_json("simulate", *args, "--device", "L40S-48GB")["device_total_peak"]["bytes"]
    assert row["unbounded_device_total"] == unbounded > usable
    assert not cli_json("simulate", *args, "--device", "L40S-48GB", "--budget", str(usable))["ooms"]
    notes = " ".join(row["notes"])
    assert "frees its whole cache and retries" in notes and "thin margin" in notes
    _, text, _ = cli("where", *args, "--devices", "L40S-48GB", "--no-max-batch")
    assert "yes (flush)" in text and "-1.04" not in text  # no negative margin beside "yes"
