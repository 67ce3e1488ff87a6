"""Issue 41: planning before the model exists.

The abstract batch budget (`max-batch --fixed X --per-sample Y --budget Z`, `pl.batch_range`): the feasible range of
B for M(B) = X + Y x B <= Z, by max-batch's own search, against the closed form floor((Z - X) / Y) computed here.
The compute plan (`peakledger plan`, `pl.plan`): C = 6ND, the tokens a budget allows, the hours at a throughput,
each figure checked against arithmetic written out in the test.
"""

from __future__ import annotations

import json
import random

import pytest
from cli_run import cli, cli_json

import peakledger as pl
from peakledger.analysis.maxbatch import ABSTRACT_LIMIT, batch_range
from peakledger.models.config import ConfigError

# --- the abstract batch budget


def test_fixed_100_per_sample_30_limit_200_is_1_to_3():
    r = pl.batch_range(fixed=100, per_sample=30, budget=200)
    assert (r.max_batch, r.feasible_range) == (3, (1, 3))  # 100 + 3 x 30 = 190 <= 200 < 220 = 100 + 4 x 30
    rc, out, err = cli("max-batch", "--fixed", "100", "--per-sample", "30", "--budget", "200")
    assert rc == 0, err
    assert "feasible micro-batches: 1..3" in out and "at B = 3: M = 190, 10 spare" in out
    assert "at B = 4: M = 220, over the budget by 20" in out
    got = cli_json("max-batch", "--fixed", "100", "--per-sample", "30", "--budget", "200")
    assert got["feasible_range"] == [1, 3] and got["max_micro_batch"] == 3 and got["closed_form"] == 3


def test_equality_at_the_limit_fits():
    r = pl.batch_range(fixed=100, per_sample=50, budget=200)  # 100 + 2 x 50 = 200: exactly the budget
    assert r.feasible_range == (1, 2) and r.memory(2) == 200
    got = cli_json("max-batch", "--fixed", "100", "--per-sample", "50", "--budget", "200")
    assert got["spare_at_max"] == 0 and got["memory_at_max"] == 200 and got["memory_one_more"] == 250
    assert pl.batch_range(fixed=200, per_sample=1, budget=200).max_batch == 0  # the fixed part alone, equal: fits
    assert pl.batch_range(fixed=0, per_sample=200, budget=200).feasible_range == (1, 1)


@pytest.mark.parametrize("fixed, per_sample, budget, best, said", [
    (250, 1, 200, -1, "the fixed part alone (250) is over the budget by 50"),
    (100, 130, 200, 0, "the fixed part fits (100), but B = 1 needs 230, over the budget by 30"),
])
def test_no_feasible_batch(fixed, per_sample, budget, best, said):
    r = pl.batch_range(fixed=fixed, per_sample=per_sample, budget=budget)
    assert r.max_batch == best and r.feasible_range is None and not r.feasible
    args = ["max-batch", "--fixed", str(fixed), "--per-sample", str(per_sample), "--budget", str(budget)]
    rc, out, err = cli(*args)
    assert rc == 0 and f"no feasible micro-batch: {said}" in out  # the answer: exit 0, max-batch's contract
    rc, out, err = cli(*args, "--check")
    assert rc == 1 and out.rstrip().endswith("fit check: DOES NOT FIT (not even B = 1)")
    got = json.loads(cli(*args, "--json")[1])
    assert got["feasible"] is False and got["feasible_range"] is None and got["max_micro_batch"] == best


def test_values_near_2_to_the_63_are_exact():
    big = 2**63
    r = pl.batch_range(fixed=big - 1, per_sample=1, budget=big)  # an int64 would overflow at B = 2: never here
    assert r.feasible_range == (1, 1) and r.memory(2) == big + 1
    assert pl.batch_range(fixed=0, per_sample=1, budget=big + 5).max_batch == big + 5
    assert pl.batch_range(fixed=1, per_sample=3, budget=2**64).max_batch == (2**64 - 1) // 3
    assert pl.batch_range(fixed=5, per_sample=2**62, budget=5 + 3 * 2**62).max_batch == 3
    got = cli_json("max-batch", "--fixed", str(big - 1), "--per-sample", "1", "--budget", str(big))
    assert got["max_micro_batch"] == 1 and got["memory_one_more"] == 9223372036854775809
    got = cli_json("max-batch", "--fixed", "0", "--per-sample", "1", "--budget", "18446744073709551621")
    assert got["max_micro_batch"] == 18446744073709551621  # 2^64 + 5, exact in the JSON text
    with pytest.raises(ConfigError, match=r"^budget: --budget .* over 2\^256"):
        pl.batch_range(fixed=0, per_sample=1, budget=ABSTRACT_LIMIT + 1)


def test_byte_units_and_no_mixing():
    r = pl.batch_range(fixed="30GiB", per_sample="1.5GiB", budget="80GiB")
    assert r.max_batch == (80 - 30) * 2 // 3 and r.budget == 80 * 2**30  # 50 GiB / 1.5 GiB = 33.3
    assert pl.batch_range(fixed="1GB", per_sample="1MB", budget="2GB").max_batch == 1000
    rc, out, err = cli("max-batch", "--fixed", "30", "--per-sample", "1.5GiB", "--budget", "80GiB")
    assert rc == 2 and err.startswith("peakledger: error: fixed: --fixed '30' has no unit while --per-sample")


def test_bisection_equals_the_closed_form_on_10000_random_cases():
    rng = random.Random(41)
    for i in range(10_000):
        bits = rng.choice((8, 16, 32, 63, 64, 80))
        fixed = rng.randrange(0, 2**bits)
        per_sample = rng.randrange(1, 2 ** rng.choice((1, 4, 16, bits)))
        budget = rng.randrange(1, 2**bits) + (fixed if i % 2 else 0)  # half of them with the fixed part inside
        best = batch_range(fixed, per_sample, budget).max_batch
        closed = (budget - fixed) // per_sample if budget >= fixed else -1
        assert best == closed, (fixed, per_sample, budget)


@pytest.mark.parametrize("flags, field, words", [
    (["--fixed", "100", "--per-sample", "0", "--budget", "200"], "per_sample", ">= 1"),
    (["--fixed", "100", "--per-sample", "30", "--budget", "0"], "budget", ">= 1"),
    (["--fixed=-1", "--per-sample", "30", "--budget", "200"], "fixed", ">= 0"),
    (["--fixed", "100", "--per-sample=-30", "--budget", "200"], "per_sample", ">= 1"),
    (["--fixed", "1e2", "--per-sample", "30", "--budget", "200"], "fixed", "a whole number"),
    (["--fixed", "100", "--per-sample", "3O", "--budget", "200"], "per_sample", "a whole number"),
    (["--fixed", "100", "--per-sample", "30", "--budget", "2gb"], "budget", "ambiguous"),
    (["--fixed", "100", "--per-sample", "30"], "budget", "--budget is missing"),
    (["--fixed", "100", "--per-sample", "30", "--budget", "200", "--preset", "gpt2"], "fixed", "drop --preset"),
    (["--fixed", "100", "--per-sample", "30", "--budget", "9" * 500], "budget", "2^256"),
])
def test_bad_abstract_values_exit_2_naming_the_flag(flags, field, words):
    rc, out, err = cli("max-batch", *flags)
    assert rc == 2 and out == ""
    assert err.startswith(f"peakledger: error: {field}: ") and words in err and err.count("\n") == 1, err
    flag = "--" + field.replace("_", "-")
    assert flag in err


@pytest.mark.parametrize("value", [True, 1.5, None, [1]])
def test_api_refuses_what_is_not_an_int_or_a_size(value):
    with pytest.raises(ConfigError, match="^per_sample: --per-sample "):
        pl.batch_range(fixed=1, per_sample=value, budget=10)
