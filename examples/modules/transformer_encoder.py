"""torch's own `nn.TransformerEncoder` for peakledger's traced describer
(`--module examples/modules/transformer_encoder.py:factory`).

Token embedding + learned positions, a 2-layer `nn.TransformerEncoder` (d_model 64, 4 heads, feed-forward
128, dropout 0.1, batch_first), a final LayerNorm and a linear head over a 256-token vocabulary, trained
with per-token cross-entropy (a masked-LM-style objective on random tokens). The batch is (tokens,
targets) and the model returns the loss. `factory(micro_batch=..., seq_len=...)` returns
(model, batch, loss_fn).

`fresh_layers` is the same model with the encoder's layers built one by one instead of cloned:
`nn.TransformerEncoder(layer, n)` deep-copies `layer` n times, and under FakeTensorMode a deep-copied
parameter's views (the weight transposes of its linear layers) report a storage of their own.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, HEADS, FF, LAYERS, MAX_LEN = 256, 64, 4, 128, 2, 512


def _layer():
    return nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=FF, dropout=0.1, batch_first=True)


class Encoder(nn.Module):
    def __init__(self, clone_layers: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.zeros(MAX_LEN, D))
        self.encoder = nn.TransformerEncoder(_layer(), LAYERS, enable_nested_tensor=False)
        if not clone_layers:
            self.encoder.layers = nn.ModuleList(_layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        logits = self.head(self.norm(self.encoder(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build(micro_batch, seq_len, clone_layers):
    model = Encoder(clone_layers)
    tokens = torch.randint(0, VOCAB, (micro_batch, seq_len))
    targets = torch.randint(0, VOCAB, (micro_batch, seq_len))
    return model, (tokens, targets), lambda loss: loss


def factory(micro_batch: int = 4, seq_len: int = 64):
    return _build(micro_batch, seq_len, clone_layers=True)


def fresh_layers(micro_batch: int = 4, seq_len: int = 64):
    return _build(micro_batch, seq_len, clone_layers=False)
