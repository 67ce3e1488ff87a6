"""Host memory reported with the device memory (total and pinned), and judged per node against the host's RAM and
pinned limit: a run that fits the GPU but not the host is flagged, and --check exits 1.

The expected figures come from the event log walked here (every Pool.HOST alloc and free) and from torch's own
rules written out: Adam keeps exp_avg and exp_avg_sq in the state dtype (fp32) for every parameter element, and
its `step` as a one-element fp32 tensor on the CPU per parameter tensor (torch/optim/adam.py `_init_group`, not
capturable, not fused); the offload's host copies of exp_avg / exp_avg_sq are pinned on a GPU (Megatron /
DeepSpeed offload buffers), the step tensors are ordinary (pageable) CPU tensors.
"""

import json

import pytest

from peakledger import api
from peakledger.analysis.host import PROCESS_BASELINE, host_fit
from peakledger.analysis.report import report_json
from peakledger.analysis.report_text import render_text
from peakledger.cli import main
from peakledger.models.training import RankRanges
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Action, Category, OptimizerState, Pool
from peakledger.traces.store import from_json, to_json

TINY = ["--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--steps", "2"]
OFFLOAD = [*TINY, "--device", "H100-80GB", "--optimizer-offload", "states"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def scenario(device="H100-80GB", **training):
    return build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, "steps": 2, **training},
                          {"device": device})


def host_walk(log, rank):
    """(peak host bytes, pinned bytes at that moment, highest pinned bytes) of `rank`, walking the log's host
    events in order."""
    total = pinned = peak = at_peak = top_pinned = 0
    for e in log.events:
        b = e.block
        if b.pool is not Pool.HOST or b.rank != rank:
            continue
        d = b.nbytes if e.action is Action.ALLOC else -b.nbytes
        total += d
        pinned += d if b.pinned else 0
        if total > peak:
            peak, at_peak = total, pinned
        top_pinned = max(top_pinned, pinned)
    return peak, at_peak, top_pinned


@pytest.fixture(scope="module")
def offloaded():
    return api.run(scenario(optimizer_offload="states"))


def test_host_rows_equal_the_log_and_torchs_adam_rule(offloaded):
    r = offloaded
    n_params = r.metadata.n_params
    tensors = {e.block.name for e in r.log.events if e.block.category is Category.PARAMETER}
    peak, pinned, top_pinned = host_walk(r.log, r.peaks.rank)
    assert pinned == top_pinned == 2 * 4 * n_params  # exp_avg + exp_avg_sq, fp32, every element: pinned
    assert peak == pinned + 4 * len(tensors)  # + one fp32 step per parameter tensor, pageable
    data = json.loads(json.dumps(report_json(r)))
    host = data["host_memory"]
    assert (host["peak"], host["pinned_at_peak"], host["pageable_at_peak"], host["pinned_peak"]) == \
        (peak, pinned, peak - pinned, top_pinned)
    assert data["host_peak"]["bytes"] == peak
    plain = report_json(api.run(scenario()))  # Adam's steps on the host, nothing pinned: the JSON of before
    assert plain["host_peak"]["bytes"] > 0 and "host_memory" not in plain


def test_pinned_split_is_the_blocks_flags(offloaded):
    host = {e.block.id: e.block for e in offloaded.log.events if e.block.pool is Pool.HOST}
    for b in host.values():
        assert b.pinned == (b.state in (OptimizerState.EXP_AVG, OptimizerState.EXP_AVG_SQ)), b
    assert not any(e.block.pinned for e in offloaded.log.events if e.block.pool is Pool.DEVICE)
    # the cpu profile has no CUDA to pin with: the same buffers, pageable
    cpu = api.run(scenario("cpu", optimizer_offload="states", precision="fp32"))
    assert any(e.block.pool is Pool.HOST for e in cpu.log.events)
    assert not any(e.block.pinned for e in cpu.log.events)


def test_pinned_survives_the_trace_file(offloaded):
    back = from_json(json.loads(json.dumps(to_json(offloaded.log))))
    assert [e.block.pinned for e in back.events] == [e.block.pinned for e in offloaded.log.events]
    plain = api.run(scenario("cpu", precision="fp32")).log  # nothing pinned: the 10-element rows of before
    assert all(len(row) == 10 for row in to_json(plain)["blocks"])


def test_save_on_cpu_and_async_staging_are_pinned():
    r = api.run(scenario(checkpointing="offload", checkpoint_every=1, save_mode="async"))
    blocks = {e.block.id: e.block for e in r.log.events if e.block.pool is Pool.HOST}
    saved = [b for b in blocks.values() if b.name.endswith(".offloaded")]
    staged = [b for b in blocks.values() if b.name.endswith(".staging")]
    assert saved and all(b.pinned for b in saved)  # save_on_cpu(pin_memory=True)
    # DCP's stager pins copies of >= 5 bytes (torch 2.13 _state_dict_stager.py pin_memory_min_bytes)
    assert staged and all(b.pinned == (b.nbytes >= 5) for b in staged)
    assert all(not b.pinned for b in blocks.values() if b.name.endswith(".placeholder"))


def test_fits_the_gpu_not_the_host_ram(capsys, offloaded):
    peak, _, _ = host_walk(offloaded.log, 0)
    need = peak + PROCESS_BASELINE  # one rank, one node
    code, out, _ = run_cli(capsys, "simulate", *OFFLOAD, "--check", "--host-memory", f"{need - 1}B")
    assert code == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("fit check: DOES NOT FIT: fits the GPU (") and "host: DOES NOT FIT (needs " in last
    code, out, _ = run_cli(capsys, "simulate", *OFFLOAD, "--check", "--host-memory", f"{need}B", "--json")
    check = json.loads(out)["fit_check"]
    assert code == 0 and check["fits"] and check["host"]["worst_node_host"]["need"] == need


def test_pinned_limit_alone(capsys, offloaded):
    _, _, top_pinned = host_walk(offloaded.log, 0)
    code, out, _ = run_cli(capsys, "simulate", *OFFLOAD, "--check", "--host-memory", "1TiB", "--pinned-limit",
                           f"{top_pinned - 1}B", "--json")
    check = json.loads(out)["fit_check"]
    assert code == 1 and not check["fits"] and check["fits_gpu"]
    assert check["host"]["fits_host_memory"] and not check["host"]["fits_pinned_limit"]
    assert check["host"]["worst_node_pinned"]["need"] == top_pinned
    # the default pinned limit: half of the host memory
    code, out, _ = run_cli(capsys, "simulate", *OFFLOAD, "--check", "--host-memory", f"{2 * top_pinned - 2}B",
                           "--json")
    check = json.loads(out)["fit_check"]
    assert check["host"]["pinned_limit"] == top_pinned - 1 and not check["host"]["fits_pinned_limit"]


def test_node_sums_its_ranks():
    """Rank 0 stages the full state dict on the host (full-rank0-offload), the others hold only Adam's steps: the
    node with rank 0 is the worst, its need the sum of its ranks' peaks + a baseline per rank."""
    r = api.run(scenario(world_size=4, dp_engine="fsdp2", checkpoint_every=1, save_mode="full-rank0-offload"))
    md = r.log.metadata
    classes = ({int(k): RankRanges.from_json(v) for k, v in md.rank_class_ranges.items()}
               if md.rank_class_ranges is not None else {int(k): RankRanges.of(v) for k, v in md.rank_classes.items()})
    per_rank = {rank: host_walk(r.log, c)[0] for c, ranks in classes.items() for rank in ranks}
    assert sorted(per_rank) == [0, 1, 2, 3] and per_rank[0] > per_rank[1] > 0
    for g in (2, 3):  # 3: the last node holds one rank
        nodes = [[rank for rank in range(4) if rank // g == n] for n in range(-(-4 // g))]
        needs = [sum(per_rank[rank] for rank in node) + len(node) * PROCESS_BASELINE for node in nodes]
        worst = max(range(len(nodes)), key=lambda n: (needs[n], -n))
        fit = host_fit(r.log, 1 << 40, gpus_per_node=g)
        assert (fit.host.node, fit.host.first, fit.host.stop, fit.host.need) == \
            (worst, nodes[worst][0], nodes[worst][-1] + 1, needs[worst])
    assert host_fit(r.log, 1 << 40).gpus_per_node == 4  # by default 8, or the world size if smaller


@pytest.mark.parametrize("device", ["RTX-4090-24GB", "H100-80GB"])
def test_a_host_not_asked_for_and_fitting_reads_as_before(capsys, device):
    """No typical node (RTX): not judged; a DGX node's 2 TiB against Adam's step tensors: judged, fits, unsaid."""
    code, out, _ = run_cli(capsys, "simulate", *TINY, "--device", device, "--check", "--json")
    assert code == 0 and "host" not in json.loads(out)["fit_check"] and "host_check" not in json.loads(out)
    code, out, _ = run_cli(capsys, "simulate", *TINY, "--device", device, "--check")
    assert code == 0 and "host" not in out.strip().splitlines()[-1] and "host per node" not in out


@pytest.mark.parametrize("argv, field", [
    (["--gpus-per-node", "0"], "gpus_per_node"),
    (["--device", "RTX-4090-24GB", "--pinned-limit", "1GiB"], "pinned_limit"),
    (["--host-memory", "lots"], "host_memory"),
])
def test_bad_host_flags_exit_2(capsys, argv, field):
    code, _, err = run_cli(capsys, "simulate", *TINY, *argv)
    assert code == 2 and field in err and len(err.strip().splitlines()) == 1


def test_explain_and_where_read_the_same_host_verdict(capsys, offloaded):
    peak, _, _ = host_walk(offloaded.log, 0)
    need = peak + PROCESS_BASELINE
    code, out, _ = run_cli(capsys, "explain", *OFFLOAD, "--check", "--host-memory", f"{need - 1}B", "--json")
    data = json.loads(out)
    assert code == 1 and data["fits"] and not data["host_check"]["fits"]  # the device fits, the host does not
    assert data["host_check"]["worst_node_host"]["need"] == need and data["host_moment"]["pool"] == "host"
    where = [a for a in OFFLOAD if a not in ("--device", "H100-80GB")]
    code, out, _ = run_cli(capsys, "where", *where, "--devices", "H100-80GB", "--no-max-batch", "--check",
                           "--host-memory", f"{need - 1}B", "--json")
    row = json.loads(out)["devices"][0]
    assert code == 1 and not row["fits"] and row["margin_bytes"] > 0 and row["host"]["worst_node_host"]["need"] == need
    code, out, _ = run_cli(capsys, "where", *where, "--devices", "H100-80GB", "--no-max-batch", "--check", "--json")
    row = json.loads(out)["devices"][0]
    assert code == 0 and row["fits"] and "host" not in row  # the DGX node's 2 TiB: fits, JSON as before


def test_the_text_report_has_the_host_ledger(offloaded):
    text = render_text(offloaded)
    assert "host ledger at the host peak (rank 0;" in text
    rows = {line.split()[0]: line.split()[1:] for line in text[text.index("host ledger"):].splitlines()[2:6]}
    assert set(rows) == {"optimizer_state.exp_avg", "optimizer_state.exp_avg_sq", "optimizer_state.step", "total"}
    assert float(rows["optimizer_state.step"][1]) == 0 < float(rows["optimizer_state.step"][0])  # pageable
    assert rows["optimizer_state.exp_avg"][0] == rows["optimizer_state.exp_avg"][1]  # pinned
    assert "host ledger" not in render_text(api.run(scenario()))  # nothing pinned: no host ledger


def test_a_fix_that_moves_memory_to_a_host_too_small_does_not_fit(offloaded):
    """explain's fixes are judged by the same host verdict: offloading the optimizer states fits the card, but not a
    node whose RAM is one byte short of the offloaded run's host need."""
    from peakledger import diagnosis
    from peakledger.analysis.host import HostLimits

    need = host_walk(offloaded.log, 0)[0] + PROCESS_BASELINE
    base = scenario()
    fits = diagnosis._fix(base, 80 << 30, "offload", {"optimizer_offload": "states"}, False, "states on the host",
                          host=HostLimits(host_memory=need))
    short = diagnosis._fix(base, 80 << 30, "offload", {"optimizer_offload": "states"}, False, "states on the host",
                           host=HostLimits(host_memory=need - 1))
    assert fits.fits and fits.note == "states on the host"
    assert not short.fits and short.note.startswith("states on the host; host: DOES NOT FIT (needs ")
