"""Weight tying for peakledger's traced describer (`--module examples/modules/tied.py:factory`).

A token model where two pairs of layers share one weight: the output head is the embedding's weight
(as GPT-2 ties them), and the second of two hidden linear layers reuses the first one's weight (so that
parameter gets two gradient contributions that torch sums before `.grad`).
The batch is (inputs, targets) and the model returns the next-token cross-entropy.
`factory(micro_batch=..., seq_len=...)` returns (model, batch, loss_fn).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D = 256, 64


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.first = nn.Linear(D, D)
        self.second = nn.Linear(D, D, bias=True)
        self.second.weight = self.first.weight  # two layers, one weight
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied embedding and output head

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        x = x + F.gelu(self.first(x))
        x = x + F.gelu(self.second(x))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def factory(micro_batch: int = 4, seq_len: int = 64):
    model = Tied()
    tokens = torch.randint(0, VOCAB, (micro_batch, seq_len + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return model, (inputs, targets), lambda loss: loss


class TiedLogits(Tied):
    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + F.gelu(self.first(x))
        x = x + F.gelu(self.second(x))
        return self.head(self.norm(x))


def closure_loss(micro_batch: int = 4, seq_len: int = 64):
    """The same model returning logits, with the targets closed over by `loss_fn` instead of passed in the
    batch (a tensor the loss reads that is not a batch tensor)."""
    model = TiedLogits()
    tokens = torch.randint(0, VOCAB, (micro_batch, seq_len + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return model, inputs, lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())
