"""explain on a GRPO run that runs out at its rollout, and vLLM's sleep-mode pool outside torch's caching allocator
(simulator/events.py Block.outside_allocator): SmolLM2-360M on a T4-16GB, each figure worked out here from the
model's config and vLLM 0.32.0's sizing (docs/rl.md)."""

from __future__ import annotations

import math

from peakledger import api
from peakledger.analysis.explain import cause
from peakledger.cli import build_parser
from peakledger.diagnosis import explain, fixes_table
from peakledger.inputs import scenario_from_args
from peakledger.simulator.device_memory import device_memory
from peakledger.simulator.events import Action, Category, EventLog, Phase, Stream, new_block, new_event

# SmolLM2-360M-Instruct (tied embeddings, no biases): hidden, layers, MLP, vocab, key-value heads, head size, positions
H, L, FF, V, KV, HD, POS = 960, 32, 2560, 49152, 5, 64, 8192
N_PARAMS = V * H + L * (2 * H * H + 2 * H * KV * HD + 3 * H * FF + 2 * H) + H
TOTAL = 15_642_329_088  # T4-16GB
ROWS = 16 * 2  # micro_batch x grad_accum: the generation batch, vLLM's max_num_seqs (TRL)
ARGS = dict(device="T4-16GB", precision="bf16", optimizer_impl="fused", micro_batch=16, grad_accum=2, seq_len=1024,
            checkpointing="full", rl="grpo", num_generations=8, max_completion_length=512, rl_beta=0.04,
            vllm="colocate", vllm_sleep_level=1, vllm_gpu_memory_utilization=0.8)
MiB = 1 << 20


def scenario(**changes):
    argv = ["simulate", "--preset", "smollm2-360m-instruct", "--describer", "hand-written"]
    for k, v in {**ARGS, **changes}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)] if not isinstance(v, bool) else [f"--{k.replace('_', '-')}"]
    return scenario_from_args(build_parser().parse_args(argv))


def vllm_weights() -> int:
    return N_PARAMS * 2 + POS * HD * 2  # bf16 parameters (vocabulary already a multiple of 64) + the rotary table


def kv_pool(utilization: float, kv_bytes: int = 2) -> int:
    requested = math.ceil(TOTAL * utilization)  # request_memory
    profile = 4096 * (2 * H + 3 * FF) * 2  # peakledger's profile-run estimate: the MLP step of 4096 tokens
    block = L * KV * 16 * 2 * HD * kv_bytes
    return (requested - vllm_weights() - profile) // block * block


def test_explain_names_the_rollout_and_ranks_the_rl_fixes():
    sc = scenario()
    x = explain(sc, TOTAL)
    assert not x.fits and x.where.startswith("step 2's rollout")
    e = x.moment.event
    assert (e.phase, e.op, e.block.name) == (Phase.ROLLOUT, "vllm.wake_up(kv_cache)", "vllm.kv_cache")
    oom = x.gpu_oom
    # vLLM maps its KV pool outside torch's allocator, beside its woken weights, after torch's cache was emptied
    assert oom.outside_allocator and oom.requested == kv_pool(0.8) == e.block.nbytes
    assert oom.point.outside_allocator == vllm_weights()
    assert oom.point.total + oom.requested > TOTAL
    assert "CuMemAllocator could not map" in oom.message
    # the why line speaks of vLLM's pool (its own bytes), not of HF generate's dynamic cache
    why = cause(e, x.moment.by_category)
    assert why.startswith(f"vLLM's KV-cache pool ({kv_pool(0.8):,} B), mapped by vLLM's CuMemAllocator")
    assert "dynamic cache" not in why and "0 B now" not in why
    # RL fixes that lower nothing are listed (sleep level 2 keeps the device's bytes): the title says so
    assert x.rl_listed and fixes_table(x)[0].startswith("fixes, each re-simulated: every RL fix tried")
    names = [f.name for f in x.fixes]
    for want in ("vllm_gpu_memory_utilization 0.8 -> 0.2", "vllm_sleep_level 1 -> 2", "offload the reference model"):
        assert want in names
    # the RL fixes the rollout calls for rank first among those that fit
    assert x.fixes[0].name.startswith("vllm_gpu_memory_utilization") and x.fixes[0].fits
    by = {f.name: f for f in x.fixes}
    # fp8 with the utilization that keeps the blocks of the bf16 pool: the smallest u with ceil(T u) - non-KV >= them
    blocks = kv_pool(0.8) // (L * KV * 16 * 2 * HD * 2)
    need = vllm_weights() + 4096 * (2 * H + 3 * FF) * 2 + blocks * L * KV * 16 * 2 * HD
    u = math.ceil(need * 10_000 / TOTAL) / 10_000
    assert by[f"kv_cache_dtype fp8, vllm_gpu_memory_utilization 0.8 -> {u}"].fits


def test_each_rl_fix_re_simulated_against_its_own_figures():
    def rollout(**changes):
        r = api.run(scenario(**changes))
        return {(p.step, p.phase): p for p in r.phases}[(2, Phase.ROLLOUT)], r

    base, _ = rollout()
    offloaded, _ = rollout(offload_reference=True)
    assert base.allocated - offloaded.allocated == 2 * N_PARAMS  # the reference model's bf16 weights
    low, report = rollout(vllm_gpu_memory_utilization=0.2)
    pools = [e.block.nbytes for e in report.log.events if e.block.name == "vllm.kv_cache" and e.action is Action.ALLOC]
    assert set(pools) == {kv_pool(0.2)}
    assert low.outside_allocator == vllm_weights() + kv_pool(0.2)  # weights and KV pool mapped, none of it reserved
    assert api.card_fit(report, TOTAL).fits


def _log(*steps):
    """(action, name, MiB, outside?) per event; one block per name."""
    blocks, events = {}, []
    for i, (action, name, mib, outside) in enumerate(steps):
        if name not in blocks:
            blocks[name] = new_block(i, mib * MiB, Category.PARAMETER, name, "bf16", outside_allocator=outside)
        events.append(new_event(i, float(i), action, blocks[name], Phase.ROLLOUT, 1, -1, Stream.COMPUTE, name))
    return EventLog(events=events, source="test")


def test_outside_allocator_blocks_take_no_segment_and_empty_the_cache_first():
    A, F = Action.ALLOC, Action.FREE
    log = _log((A, "t1", 40, False), (A, "t2", 40, False), (F, "t1", 0, False), (A, "w", 100, True),
               (F, "w", 0, True))
    dm = device_memory(log, context=10 * MiB)
    # two 40 MiB tensors: one 40 MiB segment each (large requests: their own cudaMalloc); t1 freed stays cached until
    # the mapping empties the cache, so the device total peaks at 10 + 40 + 100 MiB, not 10 + 80 + 100
    assert dm.reserved_peak.reserved == 80 * MiB
    assert dm.total_peak.total == (10 + 40 + 100) * MiB and dm.total_peak.outside_allocator == 100 * MiB
    assert dm.total_peak.reserved == 40 * MiB
    small = device_memory(log, context=10 * MiB, capacity=149 * MiB)
    assert small.oom is not None and small.oom.outside_allocator and small.oom.requested == 100 * MiB


def test_the_flag_round_trips_through_a_trace_file():
    from peakledger.traces.store import from_json, to_json

    log = _log((Action.ALLOC, "w", 1, True), (Action.ALLOC, "t", 1, False))
    data = to_json(log)
    assert [len(b) for b in data["blocks"]] == [12, 10]
    assert [b.outside_allocator for b in from_json(data).blocks().values()] == [True, False]
