import pytest

from peakledger.analysis.maxbatch import max_fitting
from peakledger.analysis.units import format_bytes, parse_bytes
from peakledger.models.config import ConfigError


def linear(fixed, per_sample):
    return lambda b: fixed + per_sample * b


def test_max_batch_examples():
    assert max_fitting(linear(100, 30), 200) == 3
    assert max_fitting(linear(100, 30), 100) == 0
    assert max_fitting(linear(100, 30), 99) == -1


def test_limits_near_2_to_the_63():
    big = 2**63
    assert max_fitting(linear(0, 1), big - 1, limit=big) == big - 1
    assert max_fitting(linear(1, 1), big, limit=big) == big - 1
    assert max_fitting(linear(0, 1), 2**70, limit=big) == big
    assert max_fitting(linear(5, 2**40), 5 + 3 * 2**40) == 3


def test_max_batch_against_brute_force():
    for fixed in (0, 7, 100):
        for per in (1, 3, 30):
            for budget in range(0, 400, 13):
                f = linear(fixed, per)
                brute = max([b for b in range(0, 500) if f(b) <= budget], default=-1)
                assert max_fitting(f, budget, limit=10**6) == brute
                for start in (2, 3, 7, 64):  # probing the scenario's own micro-batch first changes no answer
                    asked = []
                    got = max_fitting(lambda b: asked.append(b) or f(b), budget, limit=10**6, start=start)
                    assert got == brute, (fixed, per, budget, start)
                    assert asked[0] == start and (f(start) > budget or min(asked) >= start)  # none below a fit


def test_guided_search_gives_the_same_answer_on_any_non_decreasing_peak():
    """`guided` places probes where the line through two points crosses the budget: the answer is the plain search's
    for linear, stepped (allocator rounding), convex and flat-then-steep peaks, from any start, near the limit too."""
    import random

    rng = random.Random(39)
    shapes = [linear(100, 30), linear(0, 1), lambda b: 1000 + 512 * -(-(37 * b) // 512),  # rounded to 512-byte blocks
              lambda b: 50 + b * b, lambda b: 10 if b < 20 else 10 + 1000 * (b - 19),
              lambda b: 5 + 3 * b + b ** 3 // 50]
    for f in shapes:
        for _ in range(300):
            budget, start = rng.randrange(0, 20_000), rng.choice([1, 2, 3, 5, 8, 40])
            limit = rng.choice([10**6, 64, 7])
            plain = max_fitting(f, budget, limit=limit, start=start)
            assert max_fitting(f, budget, limit=limit, start=start, guided=True) == plain, (budget, start, limit)


def test_guided_search_on_a_linear_peak_probes_fewer_sizes():
    asked, guided = [], []
    max_fitting(lambda b: asked.append(b) or 1000 + 97 * b, 1000 + 97 * 37 + 50, start=2)
    max_fitting(lambda b: guided.append(b) or 1000 + 97 * b, 1000 + 97 * 37 + 50, start=2, guided=True)
    assert guided == [2, 4, 37, 38] and len(asked) > 2 * len(guided)


def test_budget_strings():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("12345B") == 12345 and parse_bytes("85899345920") == 80 * 2**30
    assert parse_bytes("24G") == parse_bytes("24gi") == parse_bytes("24GiB") == 24 * 2**30
    for bits in ("24gb", "24Gb", "1Mb", "1mib"):  # a lowercase b is a bit: refused, never read as bytes
        with pytest.raises(ConfigError, match="ambiguous"):
            parse_bytes(bits)
    assert parse_bytes("1kB") == 1000 and parse_bytes("24g") == 24 * 2**30
    for forgotten in ("80", "24", "1048575"):
        with pytest.raises(ConfigError, match="no unit"):
            parse_bytes(forgotten)
    assert format_bytes(80 * 2**30) == "80 GiB"
    assert format_bytes(80 * 10**9, "GB") == "80 GB"
    assert format_bytes(2**20, "GiB") == "1 MiB"
