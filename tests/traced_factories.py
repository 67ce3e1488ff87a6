"""Small models for the traced describer's tests: `--module tests/traced_factories.py:NAME`."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def cnn(micro_batch: int = 8):
    """Conv + BatchNorm + ReLU + pool, then a linear head: cross-entropy over 10 classes."""
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    x = torch.randn(micro_batch, 3, 32, 32)
    y = torch.randint(0, 10, (micro_batch,))
    return model, (x,), lambda out: F.cross_entropy(out, y)


class Encoder(nn.Module):
    def __init__(self, d: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)))


def encoder(micro_batch: int = 4, seq_len: int = 32):
    """torch's nn.TransformerEncoder (2 layers) with an embedding and a head."""
    ids = torch.randint(0, 128, (micro_batch, seq_len))
    return Encoder(), {"ids": ids}, lambda out: F.cross_entropy(out.flatten(0, 1), ids.flatten())


class Tied(nn.Module):
    """Two layers share one weight (an embedding tied to the output projection, and a shared hidden layer)."""

    def __init__(self, vocab: int = 96, d: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.hidden = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = torch.tanh(self.hidden(h))
        h = torch.tanh(self.hidden(h))  # the same Linear twice
        return self.out(h)


def tied(micro_batch: int = 4, seq_len: int = 16):
    ids = torch.randint(0, 96, (micro_batch, seq_len))
    return Tied(), ids, lambda out: F.cross_entropy(out.flatten(0, 1), ids.flatten())


class TiedAutoencoder(nn.Module):
    """One weight used twice, the second time transposed: `F.linear(x, w)` then `F.linear(h, w.t())`."""

    def __init__(self, d_in: int = 256, d_hidden: int = 128) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_hidden, d_in) * 0.02)
        self.b_in = nn.Parameter(torch.zeros(d_hidden))
        self.b_out = nn.Parameter(torch.zeros(d_in))

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, self.w, self.b_in)), self.w.t(), self.b_out)


def autoencoder(micro_batch: int = 64):
    """Reconstruction under mean-squared error (the loss's scalar keeps the unreduced loss's storage)."""
    x = torch.randn(micro_batch, 256)
    return TiedAutoencoder(), (x,), lambda out: F.mse_loss(out, x)


def margin_losses(micro_batch: int = 64):
    """Losses whose real kernels keep a full-size storage under a scalar (smooth L1, BCE, soft margin) or save
    a clone no op reads (hinge embedding: `(margin - x).clamp_min_(0)`)."""
    x = torch.randn(micro_batch, 32)
    target = torch.randn(micro_batch, 32)
    signs, probs = target.sign(), torch.rand(micro_batch, 32)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
    return model, (x,), lambda out: (F.smooth_l1_loss(out, target) + F.binary_cross_entropy(torch.sigmoid(out), probs)
                                     + F.soft_margin_loss(out, signs) + F.hinge_embedding_loss(out, signs))


def fixed():
    """A factory without micro_batch / seq_len: its batch cannot change."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.randn(4, 16), lambda out: out.pow(2).mean()


# -- bad factories ----------------------------------------------------------------------------------------

def raises():
    raise RuntimeError("no such dataset")


def two_tuple():
    return nn.Linear(2, 2), torch.randn(1, 2)


def not_a_module():
    return "model", torch.randn(1, 2), lambda out: out.sum()


def reads_a_value():
    """Its forward branches on a float value: fake tensors cannot answer."""
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if y.sum().item() > 0 else y
    return Gate(), torch.randn(2, 4), lambda out: out.sum()


def contrastive(micro_batch: int = 4):
    """Logits of every sample against every other (B x B): sizes quadratic in the micro-batch."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(micro_batch, 16)

    def loss_fn(z):
        logits = z @ z.t()
        return F.cross_entropy(logits, torch.arange(z.shape[0]))
    return model, (x,), loss_fn
