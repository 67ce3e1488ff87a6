"""The MLP tape: Linear(+activation) layers under mean-squared error, as traces/reference/nanogpt.py's `MLP` runs.
"""

from __future__ import annotations

from ..config import ConfigError, MLPConfig, TrainingSetup
from ..tape import Tape, TensorSpec, checkpoint_segments
from .params import mlp_params
from .writer import TapeWriter


def mlp_tape(cfg: MLPConfig, setup: TrainingSetup, cpu: bool = False) -> Tape:
    """nn.Sequential(Linear, act, Linear, act, ..., Linear) on (micro_batch, d_in); F.mse_loss, a
    fused kernel that keeps its input and target for backward. (LoRA is refused by the mlp family's check.)"""
    B = setup.batch.micro_batch
    tape = Tape(params=mlp_params(cfg))
    w = TapeWriter(tape, setup, cpu)
    x = TensorSpec("batch.x", (B, 1, cfg.d_in), setup.precision.compute if not w.autocast else "fp32", False)
    y_true = TensorSpec("batch.y", (B, 1, cfg.d_out), x.dtype, False)
    tape.inputs = [x, y_true]
    dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
    h = x
    segments = checkpoint_segments(setup, len(dims) - 1)  # a layer: one Linear and the activation after it
    if any(seg.wrap == "selective" for seg in segments):
        raise ConfigError("checkpointing", "'selective' recomputes the attention core: an MLP has none; allowed for "
                                           "MLPs: none, full, every-k, sqrt, op-policy, offload, layers")
    for segment in segments:
        for i in segment.layers:
            w.begin_layer(segment, i)
            h = w.linear(f"layers.{2 * i}", h, dims[i + 1], cfg.bias)
            if i < len(dims) - 2:
                h = w.pointwise(f"layers.{2 * i + 1}", cfg.activation, h)
    w.end_layers()
    w.op("loss.mse", "mse_loss", [h, y_true], [w.t("loss", (), h.dtype)], saves=(h.name, y_true.name),
         workspace=(w.t("loss.mse.diff", h.shape, h.dtype, False),))
    tape.held = (h.name,) if setup.loop.holds_outputs else ()
    return tape
