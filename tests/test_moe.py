"""Mixture of experts (HF Mixtral): the describer against real CPU runs of transformers' MixtralForCausalLM,
with the routing recorded from the same run; the routing input (`moe_routing`) and its counts file, checked
strictly; the Mixtral config.json keys and preset against transformers' own model; 6ND over active parameters.

Every expected number comes from a run or from transformers' model, never from a constant.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from peakledger.analysis.validate import static_rows
from peakledger.api import simulate
from peakledger.cli import main
from peakledger.models.config import ConfigError, TrainingSetup, TransformerConfig
from peakledger.models.moe import active_params, read_counts, routing_counts
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.models.transformer import transformer_params
from peakledger.models.transformer.hf_config import from_hf_config
from peakledger.scenario import Scenario
from peakledger.simulator.events import Phase
from peakledger.simulator.timeline import timeline
from peakledger.validation import measure, validate

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from peakledger.traces.reference.mixtral import RoutingRecorder, hf_mixtral, hf_mixtral_config  # noqa: E402

TINY = TransformerConfig(name="tiny-mixtral", architecture="llama", implementation="hf", n_layer=2, d_model=64,
                         n_head=4, n_kv_head=2, d_ff=96, vocab_size=256, max_seq_len=64, num_local_experts=4,
                         num_experts_per_tok=2)
TOLERANCE = 0.005


def _scenario(setup: TrainingSetup, cfg: TransformerConfig = TINY) -> Scenario:
    return Scenario(name=cfg.name, model=cfg, setup=setup, device="cpu")


EAGER = dataclasses.replace(TINY, experts_implementation="eager")


def _measure_with_counts(setup: TrainingSetup, tmp_path, hook=None, cfg: TransformerConfig = TINY):
    """A real run that records its own routing: the measured log and the counts file of its first micro-batch."""
    recorder = RoutingRecorder()

    def attach(model):
        if hook is not None:
            hook(model)
        recorder.attach(model)

    log = measure(_scenario(setup, cfg), model_hook=attach)
    path = tmp_path / f"counts-{len(list(tmp_path.iterdir()))}.json"
    recorder.write(path, setup.batch.micro_batch, setup.batch.seq_len, cfg.name)
    return log, path, recorder.layers()


def zero_routers(model):
    """Zeroed routers send every token to the same k experts (ties in topk): the worst routing, for real."""
    for name, module in model.named_modules():
        if name.endswith(".mlp.gate"):
            torch.nn.init.zeros_(module.weight)


def _phase_peak(log, phase: Phase, step: int = 1) -> int:
    return timeline(log).peak(lambda e: e.phase is phase and e.step == step).bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16"])
def test_real_mixtral_run_matches_the_simulation_with_its_own_routing(precision, tmp_path):
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision=precision, optimizer="adamw", steps=2)
    measured, path, layers = _measure_with_counts(setup, tmp_path)
    tokens = setup.batch.micro_batch * setup.batch.seq_len
    assert [sum(row) for row in layers] == [tokens * TINY.num_experts_per_tok] * TINY.n_layer
    routed = setup.replace(moe_routing=f"counts:{path}")
    v, _, simulated = validate(_scenario(routed), measured=measured)
    assert abs(v.overall.error) <= TOLERANCE, (v.overall, v.unexplained[:3])
    for phase in v.phases:
        if phase.label.startswith(("forward", "backward")):
            assert abs(phase.error) <= TOLERANCE, phase
    assert static_rows(measured) == static_rows(simulated)


def test_routing_does_not_change_memory_on_the_grouped_mm_path(tmp_path):
    """Worst routing measured (zeroed routers): its per-phase peaks equal those of the randomly initialised
    router's run, and the simulation gives the same bytes under balanced and worst routing."""
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", optimizer="adamw", steps=1)
    worst_log, _, worst_layers = _measure_with_counts(setup, tmp_path, zero_routers)
    tokens = setup.batch.micro_batch * setup.batch.seq_len
    k = TINY.num_experts_per_tok
    worst = setup.replace(moe_routing="worst")
    assert [sorted(row) for row in worst_layers] == [sorted(routing_counts(TINY, worst, i))
                                                     for i in range(TINY.n_layer)]
    assert all(sorted(row)[-k:] == [tokens] * k for row in worst_layers)
    random_log, _, random_layers = _measure_with_counts(setup, tmp_path)
    assert random_layers != worst_layers
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert (timeline(worst_log).peak(lambda e, p=phase: e.phase is p).bytes
                == timeline(random_log).peak(lambda e, p=phase: e.phase is p).bytes)
    assert timeline(worst_log).peak().bytes == timeline(random_log).peak().bytes
    sims = [timeline(simulate(describe(TINY, setup.replace(moe_routing=r), "cpu"))).peak().bytes
            for r in ("balanced", "worst")]
    assert sims[0] == sims[1] == timeline(worst_log).peak().bytes


# -- the routing input ------------------------------------------------------------------------------

SETUP = TrainingSetup(micro_batch=2, seq_len=32)


def _counts_file(tmp_path, **change) -> str:
    tokens, k, E = SETUP.batch.micro_batch * SETUP.batch.seq_len, TINY.num_experts_per_tok, TINY.num_local_experts
    row = [tokens * k // E] * E
    doc = {"format": "peakledger-moe-counts", "version": 1, "micro_batch": SETUP.batch.micro_batch,
           "seq_len": SETUP.batch.seq_len, "layers": [list(row) for _ in range(TINY.n_layer)]}
    doc.update(change)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_balanced_and_worst_counts_sum_to_tokens_times_top_k():
    for routing in ("balanced", "worst"):
        setup = SETUP.replace(seq_len=31, moe_routing=routing)  # a remainder to spread
        counts = routing_counts(TINY, setup, 0)
        assert len(counts) == TINY.num_local_experts
        assert sum(counts) == setup.batch.micro_batch * setup.batch.seq_len * TINY.num_experts_per_tok
        assert max(counts) - min(counts) <= (
            1 if routing == "balanced" else setup.batch.micro_batch * setup.batch.seq_len
        )


@pytest.mark.parametrize("change,field", [
    (dict(layers=[[32] * 4]), "moe_routing.layers"),  # one layer, the model has two
    (dict(layers=[[32] * 4, [32] * 3]), "moe_routing.layers[1]"),  # three experts, the model has four
    (dict(layers=[[32] * 4, [33, 32, 32, 32]]), "moe_routing.layers[1]"),  # sums to 129, not 128
    (dict(layers=[[32] * 4, [-1, 33, 64, 32]]), "moe_routing.layers[1][0]"),
    (dict(layers=[[32] * 4, [32.0, 32, 32, 32]]), "moe_routing.layers[1][0]"),
    (dict(layers=[[32] * 4, [True, 31, 64, 32]]), "moe_routing.layers[1][0]"),
    (dict(layers=[[32] * 4, [65, 0, 31, 32]]), "moe_routing.layers[1][0]"),  # more than the 64 tokens
    (dict(format="other"), "moe_routing.format"),
    (dict(version=2), "moe_routing.version"),
    (dict(micro_batch=4), "moe_routing.micro_batch"),
    (dict(seq_len="32"), "moe_routing.seq_len"),
    (dict(extra=1), "moe_routing.extra"),
])
def test_a_counts_file_that_does_not_fit_names_the_field(tmp_path, change, field):
    path = _counts_file(tmp_path, **change)
    with pytest.raises(ConfigError) as e:
        read_counts(path, TINY, SETUP)
    assert e.value.field == field, str(e.value)


def test_a_fitting_counts_file_is_read(tmp_path):
    setup = SETUP.replace(moe_routing=f"counts:{_counts_file(tmp_path)}")
    assert routing_counts(TINY, setup, 1) == (32, 32, 32, 32)


@pytest.mark.parametrize("argv,words", [
    (["--preset", "tiny", "--moe-routing", "worst"], "has no experts"),
    (["--preset", "mixtral-8x7b", "--moe-routing", "bogus"], "allowed: balanced, worst, counts:PATH"),
    (["--preset", "mixtral-8x7b", "--moe-routing", "counts:/nonexistent/c.json"], "moe_routing"),
])
def test_bad_routing_exits_2_with_one_line(capsys, argv, words):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1


# -- configs and parameters against transformers -----------------------------------------------------

MIXTRAL_JSON = dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96, vocab_size=256, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=64)


def _meta_model(cfg: TransformerConfig):
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(hf_mixtral_config(cfg))


@pytest.mark.parametrize("cfg", [from_hf_config(MIXTRAL_JSON), preset("mixtral-8x7b")], ids=["config.json", "preset"])
def test_parameters_are_transformers_own(cfg):
    ours = [(p.name, p.shape) for p in transformer_params(cfg)]
    theirs = [(n, tuple(p.shape)) for n, p in _meta_model(cfg).named_parameters()]
    assert ours == theirs


def test_6nd_counts_active_parameters():
    cfg = preset("mixtral-8x7b")
    model = _meta_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    inactive = experts * (cfg.num_local_experts - cfg.num_experts_per_tok) // cfg.num_local_experts
    assert active_params(cfg, total) == total - inactive
    md = describe(cfg, TrainingSetup(micro_batch=1, seq_len=128, precision="bf16-mixed", steps=1)).metadata
    assert md.n_active_params == total - inactive and md.n_params == total


@pytest.mark.parametrize("change,field", [
    (dict(output_router_logits=True), "hf_config.output_router_logits"),
    (dict(router_jitter_noise=0.1), "hf_config.router_jitter_noise"),
    (dict(sliding_window=16), "hf_config.sliding_window"),
    (dict(num_local_experts="4"), "hf_config.num_local_experts"),
    (dict(num_experts_per_tok=5), "hf_config.num_experts_per_tok"),
    (dict(attn_implementation="eager"), "attention"),
])
def test_mixtral_keys_not_modelled_are_refused_by_name(change, field):
    with pytest.raises(ConfigError) as e:
        from_hf_config({**MIXTRAL_JSON, **change})
    assert e.value.field == field, str(e.value)


def test_the_reference_model_takes_the_default_grouped_mm_path():
    model = hf_mixtral(TINY)
    assert model.config._experts_implementation == "grouped_mm"
    assert model.config._experts_implementation == transformers.MixtralForCausalLM(
        hf_mixtral_config(TINY)).config._experts_implementation


# -- the eager experts loop (experts_implementation "eager"): there the routing matters ---------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_real_eager_run_matches_the_simulation_with_its_own_routing(precision, tmp_path):
    """Exact in step 1, whose routing the counts file holds; step 2 routes differently after the update (the
    file holds one micro-batch), within the tolerance."""
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision=precision, optimizer="adamw", steps=2)
    measured, path, _ = _measure_with_counts(setup, tmp_path, cfg=EAGER)
    routed = setup.replace(moe_routing=f"counts:{path}")
    v, _, simulated = validate(_scenario(routed, EAGER), measured=measured)
    assert abs(v.overall.error) <= TOLERANCE, v.overall
    for phase in v.phases:
        assert abs(phase.error) <= TOLERANCE, phase
        if phase.label in ("forward step 1", "backward step 1"):
            assert abs(phase.measured - phase.predicted) <= 64, phase  # a loss scalar or two
    assert static_rows(measured) == static_rows(simulated)


def test_eager_routing_changes_the_backward_and_the_simulation_follows(tmp_path):
    """Worst routing (two experts hit per layer instead of four) makes fewer full-size gradient pieces of the
    3-D expert weights: a lower backward peak, measured; each run's simulation with its own counts follows."""
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision="fp32", optimizer="adamw", steps=1)
    runs = {}
    for worst in (False, True):
        log, path, _ = _measure_with_counts(setup, tmp_path, zero_routers if worst else None, cfg=EAGER)
        sim = simulate(describe(EAGER, setup.replace(moe_routing=f"counts:{path}"), "cpu"))
        runs[worst] = [(_phase_peak(log, ph), _phase_peak(sim, ph)) for ph in (Phase.FORWARD, Phase.BACKWARD)]
    measured_gap = runs[False][1][0] - runs[True][1][0]
    predicted_gap = runs[False][1][1] - runs[True][1][1]
    assert measured_gap != 0 and predicted_gap == measured_gap
    for (m, p) in runs[False] + runs[True]:
        assert abs(p - m) <= 64


def test_eager_under_autocast_is_refused():
    setup = TrainingSetup(micro_batch=2, seq_len=32, precision="bf16-autocast")
    with pytest.raises(ConfigError) as e:
        describe(EAGER, setup, "cpu")
    assert e.value.field == "experts_implementation"


def test_an_unknown_experts_implementation_is_refused(capsys):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(TINY, experts_implementation="batched_mm")
    assert e.value.field == "experts_implementation" and "grouped_mm, eager" in str(e.value)
    assert main(["simulate", "--preset", "tiny", "--experts-implementation", "eager"]) == 2
    assert "experts_implementation" in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_adafactor_factors_the_3d_expert_weights_as_torch(impl):
    """Adafactor on Mixtral's 3-D expert weights (E, 2F, D) and (E, D, F): factored over their last two dims (row_var
    (E, 2F, 1), col_var (E, 1, D)), a batched `row_var @ col_var`; the load and every optimizer phase of a real run
    allocate and free what the simulation does, in its order (the routing moves activations, not the step)."""
    setup = TrainingSetup(micro_batch=2, seq_len=32, optimizer="adafactor", optimizer_impl=impl, steps=2)
    measured = measure(_scenario(setup))
    simulated = simulate(describe(TINY, setup, "cpu"))
    experts = [e.block.shape for e in simulated.events if e.block.name.endswith("experts.gate_up_proj.row_var")]
    assert experts and all(len(shape) == 3 and shape[-1] == 1 for shape in experts)

    def events(log, phase, step):
        return [(e.action, e.delta) for e in log.events if e.phase is phase and e.step == step]

    for phase, step in ((Phase.LOAD, 0), (Phase.OPTIMIZER, 1), (Phase.ZERO_GRAD, 1), (Phase.OPTIMIZER, 2)):
        assert events(simulated, phase, step) == events(measured, phase, step)


def test_lora_on_the_hand_written_mixtral_is_refused_not_simulated_as_a_full_fine_tune():
    """Its describer never reads lora_r: a LoRA setup is refused by name, pointing at the traced HF config."""
    with pytest.raises(ConfigError, match="lora_r: LoRA on the hand-written Mixtral describer") as refused:
        describe(TINY, TrainingSetup(micro_batch=2, seq_len=16, lora_r=8), "cpu")
    assert "--describer traced" in str(refused.value)
