"""The traced describer where a model's code meets values fake tensors do not have (models/traced/realpath.py):
drop-path rates read while the model is built, random draws, masks and lengths that decide output shapes,
tensors a forward memoises, views written in place, and kernels whose outputs' layout the fake rule gets wrong.
Each model type that failed (or traced another program) before is held against a real CPU run of the same
program; what no trace can know exits 2 naming the module."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from realrun import assert_matches_real_run
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from peakledger.cli import main
from peakledger.models.config import TrainingSetup
from peakledger.models.traced import from_hf_dict, from_module_spec, recording
from peakledger.models.traced.realpath import RandomBranch, build_values
from peakledger.scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent
FACTORIES = str(Path(__file__).resolve().parent / "value_factories.py")
VIT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
           patch_size=8, num_labels=10)
STAGES = dict(image_size=32, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
              patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=10,
              drop_path_rate=0.1)
SWIN = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[2, 4], window_size=4, num_labels=10,
            drop_path_rate=0.1)
CONVNEXT = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], image_size=32, num_labels=10, drop_path_rate=0.1)
WAV2VEC2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=32,
                conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4)
VISION = {
    # drop-path rates `torch.linspace(...).tolist()` / `.item()` in __init__ (refused before: a value read)
    "convnext": dict(model_type="convnext", **CONVNEXT),
    "convnextv2": dict(model_type="convnextv2", **CONVNEXT),
    "swinv2": dict(model_type="swinv2", **SWIN),  # also an in-place ReLU on a view (view_replays)
    "data2vec-vision": dict(model_type="data2vec-vision", drop_path_rate=0.1, **VIT),
    "pvt_v2": dict(model_type="pvt_v2", **STAGES),  # image_size given as a pair after the build
    "focalnet": dict(model_type="focalnet", image_size=32, patch_size=4, embed_dim=16, depths=[1, 2],
                     focal_levels=[2, 2], focal_windows=[3, 3], num_labels=10, drop_path_rate=0.1),
    "poolformer": dict(model_type="poolformer", hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=32,
                       num_labels=10, drop_path_rate=0.1),
    "hiera": dict(model_type="hiera", embed_dim=16, image_size=[64, 64], patch_size=[7, 7], patch_stride=[4, 4],
                  patch_padding=[3, 3], depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8], num_labels=10,
                  drop_path_rate=0.1),
    # traced before, but another program than the real run's
    "swin": dict(model_type="swin", **SWIN),  # layer norm's grad_input layout
    "beit": dict(model_type="beit", use_relative_position_bias=True, drop_path_rate=0.1, **VIT),  # memoised index
    "clip": dict(model_type="clip", num_labels=10,  # the pooler's saves, no loss reads them
                 vision_config={k: v for k, v in VIT.items() if k != "num_labels"},
                 text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=256)),
    # refused before: the auto mapping gives two classes
    "deit": dict(model_type="deit", **VIT),
    "dinov2": dict(model_type="dinov2", hidden_size=64, mlp_ratio=2, num_hidden_layers=2, num_attention_heads=4,
                   image_size=32, patch_size=8, num_labels=10, drop_path_rate=0.1),
}
AUDIO = {
    "wav2vec2": dict(model_type="wav2vec2", layerdrop=0.0, **WAV2VEC2),  # CTC: masked_select, ctc_loss lengths
    "hubert": dict(model_type="hubert", layerdrop=0.0, **WAV2VEC2),
    "wav2vec2-classifier": dict(model_type="wav2vec2", layerdrop=0.0, num_labels=4,
                                architectures=["Wav2Vec2ForSequenceClassification"], **WAV2VEC2),
    "audio-spectrogram-transformer": dict(model_type="audio-spectrogram-transformer", hidden_size=64,
                                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          num_labels=10, max_length=64, num_mel_bins=32, patch_size=16),
}


def scenario(model, **setup) -> Scenario:
    base = dict(micro_batch=2, seq_len=40, steps=2, precision="fp32")
    return Scenario(name="values", model=model, setup=TrainingSetup(**{**base, **setup}), device="cpu")


def allocations(log, phase: str, targets: bool = True) -> Counter:
    """The sizes of what step 1's `phase` allocates, as a multiset; `targets` False: without the tensors a
    factory made before the run that the real run's tracker first sees where the loss reads them (the labels its
    loss_fn closes over: the simulation holds them from the start, as buffers)."""
    return Counter(e.block.nbytes for e in log.events
                   if e.step == 1 and e.phase.value == phase and e.action.value == "alloc"
                   and (targets or not e.block.name.endswith("untracked:detach")))


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- HF models held against real runs ------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(VISION))
def test_hf_vision_types_equal_real_cpu_runs(model_type):
    """The peaks within 0.5% and, allocation by allocation, the forward and backward the real run runs (BEiT's
    relative position index, memoised by transformers, lives from the start in the simulation: the real run
    makes it in its first forward). The model is traced before the real run, as `peakledger validate` does."""
    sc = scenario(from_hf_dict(VISION[model_type], model_type))
    recording(sc.model, sc.setup)  # traced first, as the CLI does: the real run after it must be unaffected
    measured, simulated = assert_matches_real_run(sc, tolerance=0.005)
    for phase in ("forward", "backward"):
        if (model_type, phase) != ("beit", "forward"):
            assert allocations(measured, phase) == allocations(simulated, phase), phase


@pytest.mark.parametrize("model_type", sorted(AUDIO))
def test_hf_audio_types_equal_real_cpu_runs(model_type):
    """CTC and audio classification batches: raw audio of seq-len frames (SpecAugment's numpy-drawn mask indexes
    the hidden states), a spectrogram for the Audio Spectrogram Transformer."""
    assert_matches_real_run(scenario(from_hf_dict(AUDIO[model_type], model_type)), tolerance=0.005)


def test_the_example_convnext_validates_from_the_cli(capsys):
    code, out, err = run_cli(capsys, "validate", "--hf-config", ROOT / "examples/hf-convnext-tiny/config.json",
                             "--micro-batch", 2, "--precision", "fp32", "--tolerance", "0.01")
    assert code == 0, err
    assert "+0.000% within tolerance" in out + err


@pytest.mark.parametrize("model_type, data, batch", [
    ("hiera", VISION["hiera"], "pixel_values 2x3x64x64 and 2 labels"),
    ("clip", VISION["clip"], "pixel_values 2x3x32x32 and 2 labels"),
    ("wav2vec2", AUDIO["wav2vec2"], "input_values 2x400 (40 frames of raw audio) and labels 2x10"),
    ("ast", AUDIO["audio-spectrogram-transformer"], "input_values 2x64x32 and 2 labels"),
])
def test_the_batch_is_named(model_type, data, batch):
    assert from_hf_dict(data, model_type).batch_note(TrainingSetup(micro_batch=2, seq_len=40)) == batch


# -- what no trace can know ----------------------------------------------------------------------------------

@pytest.mark.parametrize("data, module", [
    (dict(model_type="wav2vec2", **WAV2VEC2), "wav2vec2.encoder"),  # its default layerdrop, 0.1
    (dict(model_type="whisper", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256, pad_token_id=0,
          decoder_start_token_id=1, num_mel_bins=16, max_source_positions=32, max_target_positions=64,
          decoder_layerdrop=0.1), "model.decoder"),
])
def test_layerdrop_exits_2_naming_the_module(capsys, tmp_path, data, module):
    """A layer run or skipped at random: no single trace is the real run; the message says how to trace the step
    in which every layer runs."""
    path = tmp_path / "config.json"
    path.write_text(__import__("json").dumps(data))
    code, _, err = run_cli(capsys, "simulate", "--hf-config", path, "--micro-batch", 2, "--seq-len", 16,
                           "--device", "cpu")
    assert code == 2
    assert f"in module {module}" in err and "random draw decides a Python branch" in err
    assert "layerdrop=0.0" in err


@pytest.mark.parametrize("factory, words", [
    ("layerdrop_half", "random draw decides a Python branch"),
    ("mask_written_by_floats", "reads a tensor's value (in module model)"),
    ("mask_from_floats", "output shape depends on tensor values (in module model)"),
])
def test_values_no_trace_knows_exit_2(capsys, factory, words):
    code, _, err = run_cli(capsys, "simulate", "--module", f"{FACTORIES}:{factory}", "--device", "cpu")
    assert code == 2
    assert words in err


# -- own modules held against real runs ----------------------------------------------------------------------

@pytest.mark.parametrize("factory", ["timm_style", "layerdrop_zero", "inplace_on_views", "transposed_norm",
                                     "memoised", "known_masks"])
def test_own_modules_equal_real_cpu_runs(factory):
    """timm's drop-path rates read at build, `torch.rand([]) < 0.0` (every draw answers False), views written in
    place, a layer norm whose gradient arrives transposed, a memoised tensor, masks known from constants that
    decide output shapes: peaks within 0.5%, and the forward and backward allocate what the real run does."""
    measured, simulated = assert_matches_real_run(scenario(from_module_spec(f"{FACTORIES}:{factory}"),
                                                           micro_batch=4, seq_len=16), tolerance=0.005)
    for phase in ("forward", "backward"):
        if (factory, phase) != ("memoised", "forward"):  # the memoised tensor: from the start, as for BEiT
            assert allocations(measured, phase, targets=False) == allocations(simulated, phase), phase


def test_a_memoised_tensor_is_computed_by_each_trace_and_never_left_fake():
    """The trace computes the memoised tensor as a first forward does, whatever ran before in the process, and
    leaves the cache empty: a real run after it computes its own (a cached fake tensor would make its outputs
    fake)."""
    import sys

    model = from_module_spec(f"{FACTORIES}:memoised")
    setup = TrainingSetup(micro_batch=2, seq_len=8, precision="fp32")
    module = next(m for name, m in sys.modules.items() if name.startswith("peakledger_user_value_factories"))
    module._index(8)  # warm, as an earlier real run would leave it
    made = len(module._CACHE_HITS)
    recording(model, setup, by_depth=False)
    assert len(module._CACHE_HITS) == made + 1  # the trace computed it
    assert module._index.cache_info().currsize == 0


# -- realpath.py's pieces on their own -------------------------------------------------------------------------

def test_values_computed_from_constants_while_building_are_real():
    with FakeTensorMode(allow_non_fake_inputs=True), build_values():
        rates = [x.item() for x in torch.linspace(0, 0.3, 4)]
        split = [t.tolist() for t in torch.linspace(0, 0.3, 4).split([1, 3])]
        cumulative = torch.tensor([1, 2, 3]).cumsum(0).tolist()
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert split[1] == pytest.approx([0.1, 0.2, 0.3])
    assert cumulative == [1, 3, 6]


def test_a_random_draw_is_known_only_where_every_draw_answers_alike():
    with FakeTensorMode(allow_non_fake_inputs=True), build_values():
        assert not bool(torch.rand([]) < 0.0)  # LayerDrop 0: never skips
        assert bool(torch.rand([]) <= 1.0) and bool(torch.rand(3).ge(0.0).all())
        with pytest.raises(RandomBranch):
            bool(torch.rand([]) < 0.5)
        with pytest.raises(RandomBranch):
            (torch.rand(2) * 3).sum().item()  # made of draws and constants only


def test_a_value_written_from_unknown_values_is_unknown():
    """An in-place write whose inputs have no values takes the written tensor's value away (and its views')."""
    with FakeTensorMode(allow_non_fake_inputs=True), build_values():
        keep = torch.ones(4, dtype=torch.bool)
        view = keep[:2]
        assert bool(keep.all()) and bool(view.all())
        keep &= torch.empty(4).sum() > 0  # uninitialised memory: no value
        with pytest.raises(DataDependentOutputException):
            bool(keep.all())
        with pytest.raises(DataDependentOutputException):
            bool(view.all())


def test_a_real_build_is_untouched():
    """Without a fake mode the build runs as it is."""
    with build_values():
        x = torch.linspace(0, 1, 3)
    assert type(x) is torch.Tensor and x.tolist() == [0.0, 0.5, 1.0]
