"""Issue 39, second round: what a run computes once and shares, as behaviour (no timings). The caching allocator's
largest free block kept between calls, worked out by hand and against its search over the free lists."""

from __future__ import annotations

import random

from peakledger.simulator.allocator import AllocatorConfig, CachingAllocator

MB = 1 << 20


def _searched(m: CachingAllocator) -> int:
    """The largest free block, from the free lists themselves (every block not allocated, mapped)."""
    return max((size for lst in m._free.values() for _, size, _ in lst), default=0)


def test_the_largest_free_block_by_hand():
    m = CachingAllocator()
    assert m.largest_free() == 0
    a = m.malloc(5 * MB)  # a 20 MiB segment (torch: requests of 1 to 10 MiB), split: 15 MiB left free
    assert m.largest_free() == 15 * MB
    b = m.malloc(4 * MB)  # best fit: cut from those 15 MiB, 11 left
    assert m.largest_free() == 11 * MB
    c = m.malloc(11 * MB)  # those 11 MiB taken whole: nothing free
    assert m.largest_free() == 0
    m.free(a)  # 5 MiB free, before the 4 MiB still allocated
    assert m.largest_free() == 5 * MB
    m.free(c)  # 11 MiB free, after it
    assert m.largest_free() == 11 * MB
    m.free(b)  # merged with both neighbours: the whole 20 MiB segment
    assert m.largest_free() == 20 * MB
    m.release_cached_blocks()  # torch.cuda.empty_cache
    assert m.largest_free() == 0


def test_the_largest_free_block_kept_is_the_one_searched_at_every_step():
    rng = random.Random(39)
    for conf in ("", "expandable_segments:True", "max_split_size_mb:32"):
        m = CachingAllocator(AllocatorConfig.parse(conf))
        live = []
        for step in range(3000):
            r = rng.random()
            if live and r < 0.45:
                m.free(live.pop(rng.randrange(len(live))))
            elif r < 0.47:
                m.release_cached_blocks()
            else:
                size = rng.choice([512, 3000, 1 << 16, 3 * MB, 11 * MB, 37 * MB, rng.randrange(1, 64 * MB)])
                live.append(m.malloc(size, stream=rng.choice([0, 0, 1])))
            assert m.largest_free() == _searched(m), (conf, step)


def test_a_card_its_live_tensors_cannot_fit_is_judged_without_a_bounded_replay(monkeypatch):
    from peakledger import api
    from peakledger.analysis import card_fit as card_fit_module
    from peakledger.analysis.device import gpu_memory
    from peakledger.scenario import build_scenario

    sc = build_scenario({"preset": "gpt2"}, {"micro_batch": 2, "seq_len": 256}, {"device": "H100-80GB"})
    report = api.run(sc)
    gpu = report.gpu
    tensors, outside = gpu.at_allocated_peak.allocated, gpu.outside_total
    calls = []
    real = card_fit_module.gpu_memory
    monkeypatch.setattr(card_fit_module, "gpu_memory", lambda *a, **k: calls.append(k) or real(*a, **k))
    # one byte less than the live tensors and what lies outside the allocator: no bounded replay is made...
    budget = tensors + outside - 1
    verdict = api.card_fit(report, budget)
    assert calls == [] and not verdict.fits
    assert (verdict.need, verdict.unbounded, verdict.point) == (gpu.total_peak.total, gpu.total_peak.total,
                                                                gpu.total_peak)
    # ... and the bounded replay it spared stops at an OOM, as the verdict says
    assert gpu_memory(report.log, gpu.rank, capacity=budget).oom is not None
    # with room for the tensors (under the unbounded device total), the bounded run is replayed
    if tensors + outside < gpu.total_peak.total:
        api.card_fit(report, tensors + outside)
        assert [k.get("capacity") for k in calls] == [tensors + outside]


def test_the_ledgers_row_maxima_from_the_timelines_columns_equal_the_walk():
    import dataclasses

    from peakledger import api
    from peakledger.analysis.ledger import ledger_at, row_name
    from peakledger.scenario import build_scenario

    for training in ({"lora_r": 8}, {"optimizer": "adamw"}, {"precision": "bf16-mixed", "steps": 2}):
        sc = build_scenario({"preset": "tiny-llama"}, {"micro_batch": 2, "seq_len": 32, **training},
                            {"device": "H100-80GB"})
        report = api.run(sc)
        tl = report.timeline
        walked = dataclasses.replace(tl, total=tl.total.astype(object))  # Python ints: every row walks the events
        for index in (report.peaks.overall.index, 0, len(tl.events) - 1):
            assert ledger_at(tl, index) == ledger_at(walked, index)
        # each row's maximum, by hand: its running bytes over the events, from 0
        lora = bool(training.get("lora_r"))
        running, top = {}, {}
        for e in tl.events:
            name = row_name(e.block, lora)
            running[name] = running.get(name, 0) + e.delta
            top[name] = max(top.get(name, 0), running[name])
        assert {r.row: r.max_bytes for r in report.ledger} == top
        assert any(r.row.startswith("optimizer_state.") for r in report.ledger)


def test_a_fix_of_the_allocators_settings_alone_shares_the_runs_simulation(monkeypatch):
    from peakledger import api, diagnosis
    from peakledger.analysis.report import report_json
    from peakledger.scenario import build_scenario

    sc = build_scenario({"preset": "gpt2"}, {"micro_batch": 4, "seq_len": 512, "precision": "bf16-mixed"},
                        {"device": "H100-80GB"})
    calls = []
    real = api.describe
    monkeypatch.setattr(api, "describe", lambda *a, **k: calls.append(1) or real(*a, **k))
    base = api.run(sc)
    budget = base.gpu.total_peak.total - (64 << 20)
    assert len(calls) == 1
    for changes in ({"alloc_conf": "expandable_segments:True"}, {"alloc_conf": "max_split_size_mb:128"},
                    {"empty_cache_before_save": True}):
        shared = diagnosis._fix(sc, budget, "fix", changes, False, "", base=base)
        assert len(calls) == 1  # no description (nor simulation) of its own
        fresh = diagnosis._fix(sc, budget, "fix", changes, False, "")
        assert len(calls) == 2
        calls.clear()
        calls.append(1)
        assert shared == fresh
        assert report_json(api.rerun_allocator(base, sc.with_changes(**changes))) == \
            report_json(api.run(sc.with_changes(**changes)))
        calls[:] = [1]
    # a fix that changes the training is described anew
    diagnosis._fix(sc, budget, "fix", {"optimizer": "sgd"}, True, "", base=base)
    assert len(calls) == 2
