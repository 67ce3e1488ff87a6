"""The batch a traced HF model runs (models/traced/model.py `_hf_build`): token ids and labels for a text model, random
images for a vision one, raw audio or a spectrogram for an audio one, both for a contrastive pair of towers; and
their shapes in words (`TracedModel.batch_note`)."""

from __future__ import annotations

from math import prod

from ..config import ConfigError, TrainingSetup

CONTRASTIVE = "contrastive"  # the task of a model of a text and an image tower trained on their contrastive loss


def hf_batch(config, task: str, setup: TrainingSetup, dtype):
    import torch

    B, T = setup.batch.micro_batch, setup.batch.seq_len
    g = torch.Generator().manual_seed(0)
    if task == "AutoModelForImageClassification":
        # a model of an image and a text tower (CLIP, SigLIP) holds the image's size in its vision config
        vision = config if hasattr(config, "image_size") else getattr(config, "vision_config", config)
        batch = {"pixel_values": pixel_values(vision, B, g, dtype),
                 "labels": torch.randint(0, max(config.num_labels, 1), (B,), generator=g)}
    elif task == "AutoModelForSpeechSeq2Seq":
        frames = 2 * getattr(config, "max_source_positions", 1500)
        batch = {"input_features": torch.randn(B, config.num_mel_bins, frames, generator=g, dtype=dtype),
                 "labels": torch.randint(0, config.vocab_size, (B, T), generator=g)}
    elif task in AUDIO_TASKS:
        batch = {"input_values": audio_values(config, B, T, g, dtype)}
        if task == "AutoModelForCTC":  # token ids, never the pad id (Wav2Vec2ForCTC's blank is pad_token_id)
            vocab, pad = config.vocab_size, getattr(config, "pad_token_id", None)
            if isinstance(pad, int) and 0 <= pad < vocab:
                ids = torch.randint(0, vocab - 1, (B, ctc_label_len(T)), generator=g)
                ids += (ids >= pad).long()  # skip the pad id
            else:
                ids = torch.randint(0, vocab, (B, ctc_label_len(T)), generator=g)
            batch["labels"] = ids
        else:
            batch["labels"] = torch.randint(0, max(config.num_labels, 1), (B,), generator=g)
    elif task == CONTRASTIVE:
        # its two towers' configs (CLIPConfig: text_config, vision_config)
        text, vision = getattr(config, "text_config", config), getattr(config, "vision_config", config)
        batch = {"input_ids": torch.randint(0, text.vocab_size, (B, T), generator=g),
                 "pixel_values": pixel_values(vision, B, g, dtype), "return_loss": True}
    else:
        ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
    return batch


AUDIO_TASKS = ("AutoModelForCTC", "AutoModelForAudioClassification")


def audio_values(config, B: int, T: int, g, dtype):
    """An audio model's `input_values`: raw 16 kHz samples for a model that convolves the waveform (Wav2Vec2,
    HuBERT, WavLM, ...: `conv_stride`), T frames of it (T x the strides' product samples, 320 for Wav2Vec2: 20 ms
    a frame); a spectrogram of the config's `max_length` frames x `num_mel_bins` for the Audio Spectrogram
    Transformer (its feature extractor pads or cuts to max_length)."""
    import torch

    if hasattr(config, "conv_stride"):
        return torch.randn(B, T * stride_product(config.conv_stride), generator=g, dtype=dtype)
    if hasattr(config, "max_length") and hasattr(config, "num_mel_bins"):
        return torch.randn(B, config.max_length, config.num_mel_bins, generator=g, dtype=dtype)
    raise ConfigError("model_type", f"{config.model_type!r}: peakledger has no audio batch for it (raw audio for "
                                    "models with conv_stride, a spectrogram of max_length x num_mel_bins)")


def stride_product(strides) -> int:
    return prod(int(s) for s in strides)


def ctc_label_len(T: int) -> int:
    """CTC targets of one token per 4 frames (80 ms: LibriSpeech's ~15 characters a second), at least one."""
    return max(1, T // 4)


def pixel_values(vision, B: int, g, dtype):
    """A batch of B random images of a (vision) config's `image_size` and `num_channels`."""
    import torch

    (h, w), channels = image_hw(getattr(vision, "image_size", 224)), getattr(vision, "num_channels", 3)
    return torch.randn(B, channels, h, w, generator=g, dtype=dtype)


def pixels_note(vision: dict, B: int) -> str:
    """`pixel_values`' shape, in words, from the config's dict."""
    h, w = image_hw(vision.get("image_size", 224))
    return f"pixel_values {B}x{vision.get('num_channels', 3)}x{h}x{w}"


def image_hw(size) -> tuple[int, int]:
    """(height, width) of a config's `image_size`: one int (square), or a pair (Hiera, PVT-v2, TextNet)."""
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    return int(size), int(size)


__all__ = ["hf_batch", "AUDIO_TASKS", "CONTRASTIVE", "audio_values", "stride_product", "ctc_label_len",
           "pixel_values", "pixels_note", "image_hw"]
