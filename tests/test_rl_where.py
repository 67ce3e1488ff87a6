"""`where` and `simulate --check` for a GRPO run with a colocated vLLM engine (peakledger/where_rl.py): SmolLM2-360M
on a T4-16GB (tests/test_rl_explain.py's example), each vLLM figure worked out here from the model's config and vLLM
0.32.0's formulas (docs/rl.md), the training process's holdings read from a plain simulate run's JSON."""

from __future__ import annotations

import json
import math

from peakledger import api
from peakledger.where import where
from tests.cli_run import cli
from tests.test_rl_explain import (
    ARGS,
    FF,
    HD,
    KV,
    TOTAL,
    H,
    L,
    kv_pool,
    scenario,
    vllm_weights,
)

BLOCK = L * KV * 16 * 2 * HD * 2  # one bf16 block of every layer (16 tokens of K and V)
PROFILE = 4096 * (2 * H + 3 * FF) * 2  # peakledger's profile-run estimate (the MLP step of 4096 tokens)
SEQ = ARGS["seq_len"]


def argv(**changes) -> list[str]:
    out = ["simulate", "--preset", "smollm2-360m-instruct", "--describer", "hand-written"]
    for k, v in {**ARGS, **changes}.items():
        out += [f"--{k.replace('_', '-')}", str(v)] if not isinstance(v, bool) else [f"--{k.replace('_', '-')}"]
    return out


def simulate_json(*extra, **changes) -> tuple[int, dict]:
    rc, out, err = cli(*argv(**changes), *extra, "--json")
    return rc, json.loads(out)


def fits(**changes) -> bool:
    return api.card_fit(api.run(scenario(**changes)), TOTAL).fits


def test_where_gives_the_rollout_batch_and_the_utilization_range():
    # the training process's holdings at the engine's start: a run with HF generate (no engine) holds at the end of
    # its load what TRL's __init__ holds when it builds the engine (policy + buffers + reference), + the CUDA context
    _, plain = simulate_json(vllm="none", vllm_sleep_level=0)
    load = next(p for p in plain["phases"] if p["phase"] == "load")
    in_use = load["allocated"] + plain["device_memory"]["context_bytes"]
    u = 0.3
    rl = where(scenario(vllm_gpu_memory_utilization=u), ["T4-16GB"]).placements[0].rl
    assert rl.in_use == in_use
    # vLLM's formulas: min_utilization holds one 1024-token request and the null block; max_utilization the largest
    # 4-decimal share with ceil(total x u) within what the training process leaves free
    need = vllm_weights() + PROFILE + BLOCK * (1 + math.ceil(SEQ / 16))
    assert rl.u_min == math.ceil(need * 10_000 / TOTAL) / 10_000
    top = math.floor((TOTAL - in_use) * 10_000 / TOTAL)
    while math.ceil(TOTAL * top / 10_000) > TOTAL - in_use:
        top -= 1
    assert rl.u_start == top / 10_000
    # the KV pool at 0.3 and what it holds at once: (blocks - 1) // cdiv(1024, 16), TRL's max_num_seqs (32) the cap
    blocks = kv_pool(u) // BLOCK
    assert rl.pool_blocks == blocks and rl.pool_sequences == (blocks - 1) // (SEQ // 16)
    assert rl.engine_bound == min(rl.pool_sequences, ARGS["micro_batch"] * ARGS["grad_accum"])
    # the top of the range fits the card, one hundredth above it does not, below the start limit; the least fits
    assert rl.u_min <= rl.u_fit < rl.u_over <= rl.u_start and round(rl.u_over - rl.u_fit, 4) <= 0.01
    assert fits(vllm_gpu_memory_utilization=rl.u_fit) and not fits(vllm_gpu_memory_utilization=rl.u_over)
    assert rl.u_min_fits and fits(vllm_gpu_memory_utilization=rl.u_min)
    # the rollout batch: micro-batches TRL accepts at grad_accum 2 (8 | 2 mb: multiples of 4); the largest fits,
    # the next one does not
    assert rl.step == 4 and rl.max_micro_batch % 4 == 0 and rl.max_micro_batch >= ARGS["micro_batch"]
    assert fits(vllm_gpu_memory_utilization=u, micro_batch=rl.max_micro_batch)
    assert not fits(vllm_gpu_memory_utilization=u, micro_batch=rl.max_micro_batch + 4)
    assert rl.max_rows == rl.max_micro_batch * ARGS["grad_accum"]


def test_simulate_check_counts_vllms_mapped_memory():
    ok, good = simulate_json("--check", vllm_gpu_memory_utilization=0.3)
    bad, over = simulate_json("--check", vllm_gpu_memory_utilization=0.8)
    assert (ok, bad) == (0, 1)
    context = over["device_memory"]["context_bytes"]
    peak = over["device_total_peak"]
    # at 0.8 the peak is step 2's rollout: vLLM's weights and KV pool mapped outside torch's allocator; torch's
    # reserved segments and the context alone fit the card, with the mapping they do not
    assert (peak["op"], peak["step"]) == ("vllm.wake_up(kv_cache)", 2)
    assert peak["outside_allocator"] == vllm_weights() + kv_pool(0.8)
    assert peak["device_total"] == context + peak["reserved"] + peak["outside_allocator"]
    assert context + peak["reserved"] <= TOTAL < peak["device_total"] == over["fit_check"]["capacity_needed"]
    # at 0.3 the rollout's device total holds the mapping too, and every figure is within the card
    rollout = next(p for p in good["phases"] if (p["step"], p["phase"]) == (2, "rollout"))
    assert rollout["device_total"] >= context + vllm_weights() + kv_pool(0.3)
    assert good["fit_check"]["capacity_needed"] == good["device_total_peak"]["device_total"] <= TOTAL


def test_a_card_where_vllm_refuses_to_start_is_a_no_row():
    # utilization 0.03: vLLM's KV pool holds no 1,024-token request on the T4 (its least is above 0.05) and does on the
    # A100-40GB (0.02): the T4 is a row that does not fit, with no sizes and vLLM's reason; the A100 is judged
    flags = argv(vllm_gpu_memory_utilization=0.03)[1:]
    at = flags.index("--device")
    cmd = ["where", *flags[:at], *flags[at + 2:], "--devices", "T4-16GB,A100-40GB", "--no-max-batch"]
    rc, out, err = cli(*cmd, "--json")
    assert rc == 0, err
    t4, a100 = json.loads(out)["devices"]
    assert t4["refused"].startswith("vLLM refuses to start") and t4["fits"] is False
    assert t4["allocated_peak"] is t4["margin_bytes"] is t4["capacity_needed"] is None
    assert t4["notes"] == [t4["refused"]]
    assert a100["fits"] is True and "refused" not in a100
    rc, text, _ = cli(*cmd, "--check")
    assert rc == 0 and "no (refused)" in text and "fits on 1 of 2: A100-40GB" in text
    assert cli(*cmd[:-3], "--devices", "T4-16GB", "--no-max-batch", "--check")[0] == 1  # fits nowhere: 1, not 2
