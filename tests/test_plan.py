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


# --- the compute plan

H100_BF16 = 989.4e12  # NVIDIA H100 SXM5 datasheet, dense BF16 (bench/SOURCES.md), and models/devices.py's assumed 50%


def test_c_is_6nd_for_the_two_questions_of_the_issue():
    got = cli_json("plan", "--params", "5e7,1e9", "--tokens", "2e8")
    assert [r["compute_flops"] for r in got["rows"]] == [6 * 50_000_000 * 200_000_000, 6 * 10**9 * 200_000_000]
    assert got["rows"][0]["compute_flops"] == 60_000_000_000_000_000  # 6 x 10^16
    got = cli_json("plan", "--params", "1e9", "--tokens", "2e10")
    assert got["rows"][0]["compute_flops"] == 120_000_000_000_000_000_000  # 1.2 x 10^20, an exact int
    assert got["rows"][0]["tokens_per_param"] == 20.0 and got["question"] == "compute"
    rc, out, err = cli("plan", "--params", "5e7", "--tokens", "2e8")
    assert rc == 0, err
    assert out.splitlines()[3].split() == ["50M", "3.00e8", "200M", "4.00", "6.00e16"]  # N, 6N, D, D/N, C


def test_tokens_a_budget_allows_each_size():
    got = cli_json("plan", "--compute", "1.2e20", "--params", "5e7", "--params", "1B,7B")
    tokens = [r["tokens"] for r in got["rows"]]
    # 1.2e20 / (6 x 5e7) = 4e11; / (6 x 1e9) = 2e10; / (6 x 7e9) = 2.857142857...e9, whole tokens: floor
    assert tokens == [400_000_000_000, 20_000_000_000, 2_857_142_857]
    assert got["rows"][2]["compute_flops"] == 2_857_142_857 * 42_000_000_000 <= 12 * 10**19
    assert got["compute_budget_flops"] == 12 * 10**19 and got["question"] == "tokens"
    assert [r["n_params"] for r in got["rows"]] == [50_000_000, 10**9, 7 * 10**9]


def test_hours_at_a_measured_throughput():
    p = pl.plan(5e7, tokens=2e8, tokens_per_s=1e5)  # Python floats: read as the decimals they print as
    assert p.rows[0].seconds == 2000.0 and p.rows[0].gpu_hours == pytest.approx(2000 / 3600, rel=1e-15)
    got = cli_json("plan", "--params", "1e9", "--tokens", "2e10", "--tokens-per-s-per-gpu", "3000", "--gpus", "8")
    row = got["rows"][0]
    assert row["wall_clock_s"] == pytest.approx(2e10 / (3000 * 8), rel=1e-15)  # 833,333 s = 231.5 h
    assert row["gpu_hours"] == pytest.approx(2e10 / (3000 * 8) * 8 / 3600, rel=1e-15)  # 1,851.9
    total = cli_json("plan", "--params", "1e9", "--tokens", "2e10", "--tokens-per-s", "24k", "--gpus", "8")["rows"][0]
    assert total["wall_clock_s"] == row["wall_clock_s"] and total["gpu_hours"] == row["gpu_hours"]
    # one throughput per size, in --params order
    each = pl.plan("1B,7B", compute="1.2e20", tokens_per_s="20000,2500")
    assert each.rows[0].seconds == 2 * 10**10 / 20000 and each.rows[1].seconds == pytest.approx(2_857_142_857 / 2500)


def test_the_cost_model_is_labelled_as_such():
    got = cli_json("plan", "--params", "1e9", "--tokens", "2e10", "--device", "H100-80GB", "--gpus", "8")
    assert got["rows"][0]["wall_clock_s"] == pytest.approx(1.2e20 / (8 * H100_BF16 * 0.5), rel=1e-12)  # 8.4 h
    assert got["time_source"].startswith("peakledger's cost model (models/devices.py), not a measurement: H100-80GB")
    assert "50% efficiency assumed" in got["time_source"] and "8 GPUs" in got["time_source"]
    t4 = pl.plan(1e9, tokens=2e10, device="T4-16GB")  # no bf16 path: its fp32 peak, said
    assert "(no bf16 path: fp32's)" in t4.time_source and t4.rows[0].seconds == pytest.approx(1.2e20 / (8.1e12 * .5))


def test_a_known_models_terms_are_printed_one_by_one():
    p = pl.plan(preset="gpt2", tokens="1e9")
    # GPT-2 small: 124,439,808 parameters; wte 50,257 x 768 and wpe 1,024 x 768 are its embedding tables (tied head)
    non_embedding = 124_439_808 - 50_257 * 768 - 1_024 * 768
    assert non_embedding == 85_056_000
    assert [(t.name, t.per_token) for t in p.terms] == [
        ("non-embedding parameters", 6 * 85_056_000), ("attention", 6 * 12 * 1024 * 768),
        ("vocabulary head", 6 * 768 * 50_257)]
    rule, kaplan = p.rows
    assert rule.flops_per_token == 6 * 124_439_808 and rule.compute == 6 * 124_439_808 * 10**9
    assert kaplan.flops_per_token == 510_336_000 + 56_623_104 + 231_584_256
    rc, out, err = cli("plan", "--preset", "gpt2", "--tokens", "1e9", "--seq-len", "512")
    assert rc == 0, err
    assert "attention" in out and "6 x n_layer x n_ctx x d_attn = 6 x 12 x 512 x 768" in out
    assert "vocabulary head" in out and "6 x d_model x n_vocab = 6 x 768 x 50,257" in out
    assert "Kaplan et al. 2020, arXiv:2001.08361" in out and "12 x n_layer x n_ctx x d_attn" in out


def test_mixture_of_experts_active_and_total():
    got = cli_json("plan", "--params", "47B", "--active-params", "13B", "--tokens", "1T")
    row = got["rows"][0]
    assert (row["n_params"], row["n_active"]) == (47 * 10**9, 13 * 10**9)
    assert row["compute_flops"] == 6 * 13 * 10**9 * 10**12 and row["tokens_per_param"] == 10**12 / (13 * 10**9)
    rc, out, err = cli("plan", "--params", "47B", "--active-params", "13B", "--tokens", "1T")
    assert "active N" in out and "tokens/active param" in out and "  experts: a mixture of experts" in out
    # Mixtral 8x7B: 8 experts of 3 x 4,096 x 14,336 per layer, 32 layers, top-2: six experts a token skips
    mixtral = pl.plan(preset="mixtral-8x7b", tokens="1e9").model
    assert mixtral.n_active == mixtral.n_params - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248
    # a traced config.json (transformers' MixtralForCausalLM on the meta device): 256 x 64 embeddings, an untied
    # head, 2 layers of q 64x64, k and v 64x32, o 64x64, a 4x64 router, 4 experts of 3 x 64 x 96, 2 norms; final norm
    tiny = pl.plan(hf_config="examples/hf-mixtral-tiny/config.json", tokens="1e6").model
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 4 * 64 + 4 * 3 * 64 * 96 + 2 * 64
    assert tiny.n_params == 256 * 64 + 2 * layer + 64 + 256 * 64 == 205_632
    assert tiny.n_active == tiny.n_params - 2 * 2 * 3 * 64 * 96 and tiny.experts == "top-2 of 4 experts"
    assert tiny.n_embedding == 2 * 256 * 64


def test_unique_tokens_and_tokens_seen_are_separate_columns():
    got = cli_json("plan", "--params", "1B", "--tokens", "4e11", "--unique-tokens", "1e11")
    assert got["rows"][0]["unique_tokens"] == 10**11 and got["rows"][0]["tokens"] == 4 * 10**11
    assert got["rows"][0]["epochs"] == 4.0
    rc, out, err = cli("plan", "--params", "1B", "--tokens", "4e11", "--unique-tokens", "1e11")
    head, cells = out.splitlines()[2:4]
    assert "unique tokens" in head and "epochs" in head and cells.split()[3:5] == ["100B", "4.00"]
    assert "arXiv:2305.16264" in out


def test_a_budgets_n_d_choices_and_the_chinchilla_reference():
    got = cli_json("plan", "--compute", "6e16")
    # 6ND = 6e16: D = 1e16 / N; N on 1, 2, 5 x 10^k with D / N = 1e16 / N^2 from 1 to 10,000: N = 1e6 .. 1e8
    assert [r["n_params"] for r in got["rows"]] == [10**6, 2 * 10**6, 5 * 10**6, 10**7, 2 * 10**7, 5 * 10**7, 10**8]
    assert [r["tokens"] for r in got["rows"]] == [10**16 // n for n in (10**6, 2 * 10**6, 5 * 10**6, 10**7,
                                                                       2 * 10**7, 5 * 10**7, 10**8)]
    assert got["chinchilla_reference"] == {"n_params": 22_360_679, "tokens": 447_213_580}  # sqrt(6e16 / 120)
    rc, out, err = cli("plan", "--compute", "6e16")
    assert "reference, not a verdict: Hoffmann et al. 2022" in out and "arXiv:2203.15556" in out
    assert "under one epoch of MassiveText" in out and "70M to 16B parameters" in out
    assert "optimal" not in out.replace("Compute-Optimal", "")  # no row is called optimal


def test_same_input_same_output_and_a_frozen_result():
    first = cli("plan", "--compute", "1e21", "--params", "125M,1B,7B", "--tokens-per-s-per-gpu", "3000", "--gpus", "8")
    assert first == cli("plan", "--compute", "1e21", "--params", "125M,1B,7B", "--tokens-per-s-per-gpu", "3000",
                        "--gpus", "8") and first[0] == 0
    p = pl.plan("1B", tokens="2e10")
    with pytest.raises(AttributeError):
        p.rows = ()


@pytest.mark.parametrize("flags, field, words", [
    (["--params", "0", "--tokens", "2e8"], "params", "> 0"),
    (["--params", "5e7x", "--tokens", "2e8"], "params", "cannot read"),
    (["--params", "2.5", "--tokens", "2e8"], "params", "not a whole number"),
    (["--params", "5e7,", "--tokens", "2e8"], "params", "empty value"),
    (["--params", "5e7", "--tokens", "2e8", "--compute", "6e16"], "tokens", "not both"),
    (["--params", "5e7"], "compute", "--tokens D"),
    (["--tokens", "2e8"], "params", "needs a model size"),
    (["--compute", "1e31"], "compute", "at most 1e30"),
    (["--compute", "6e16", "--gpus", "8"], "gpus", "--tokens-per-s"),
    (["--compute", "6e16", "--tokens-per-s", "1e5", "--device", "H100-80GB"], "device", "one source of time"),
    (["--compute", "6e16", "--tokens-per-s", "0"], "tokens_per_s", "> 0"),
    (["--compute", "6e16", "--params", "1B,7B", "--tokens-per-s", "1,2,3"], "tokens_per_s", "one per --params"),
    (["--compute", "6e16", "--params", "1B", "--active-params", "2B"], "active_params", "more than"),
    (["--compute", "6e16", "--params", "1B", "--seq-len", "2048"], "seq_len", "--preset"),
    (["--compute", "6e16", "--compute-dtype", "bf16"], "compute_dtype", "--device"),
    (["--compute", "6e16", "--device", "H100"], "device", "did you mean"),
    (["--compute", "6e16", "--preset", "gpt-2"], "preset", "gpt2"),
    (["--compute", "6e16", "--preset", "gpt2", "--params", "1B"], "params", "drop one"),
    (["--compute", "6e16", "--preset", "tiny-mlp"], "preset", "--params"),
    (["--compute", "6e16", "--preset", "gpt2", "--seq-len", "4096"], "seq_len", "max_seq_len 1024"),
    (["--compute", "6e16", "--hf-config", "examples/hf-t5-tiny/config.json"], "hf_config", "not a causal LM"),
])
def test_bad_plan_input_exits_2_naming_the_flag(flags, field, words):
    rc, out, err = cli("plan", *flags)
    assert rc == 2 and out == ""
    assert err.startswith(f"peakledger: error: {field}: ") and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", [True, float("nan"), 1e400, -5, [], "1e9 tokens"])
def test_the_api_checks_as_the_flags_do(value):
    with pytest.raises(ConfigError, match="^tokens: --tokens "):
        pl.plan(1e9, tokens=value)
