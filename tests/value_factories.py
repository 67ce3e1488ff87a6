"""Own modules (`--module tests/value_factories.py:NAME`) whose code reads tensor values or writes views in place,
for tests/test_traced_values.py: each returns (model, batch, loss_fn) as models/traced/model.py documents."""

from __future__ import annotations

import torch
from torch import nn


class DropPath(nn.Module):
    """timm's stochastic depth: a random draw that only scales (no value is read)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class Block(nn.Module):
    def __init__(self, dim: int, drop_path: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        return x + self.drop_path(self.fc2(torch.relu(self.fc1(self.norm(x)))))


class TimmStyle(nn.Module):
    """The drop-path rates read off a `torch.linspace` while the model is built (timm's VisionTransformer:
    `dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]`)."""

    def __init__(self, dim: int = 32, depth: int = 3, drop_path_rate: float = 0.2) -> None:
        super().__init__()
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList(Block(dim, r) for r in dpr)
        self.head = nn.Linear(dim, 10)
        self.rates = dpr

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def _batch(micro_batch: int, seq_len: int, dim: int = 32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(micro_batch, seq_len, dim, generator=g), torch.randint(0, 10, (micro_batch,), generator=g)


def timm_style(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    model = TimmStyle()
    assert model.rates[-1] > 0.19  # the real rates, also when built on fake tensors
    return model, x, lambda out: nn.functional.cross_entropy(out, y)


class LayerDrop(nn.Module):
    """transformers' Wav2Vec2 encoder: `skip = torch.rand([]) < layerdrop` per layer, no `layerdrop > 0` guard."""

    def __init__(self, layerdrop: float, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.layerdrop = layerdrop
        self.layers = nn.ModuleList(Block(dim, 0.0) for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        for layer in self.layers:
            skip = self.training and torch.rand([]) < self.layerdrop
            if not skip:
                x = layer(x)
        return self.head(x.mean(1))


def layerdrop_zero(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return LayerDrop(0.0), x, lambda out: nn.functional.cross_entropy(out, y)


def layerdrop_half(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return LayerDrop(0.5), x, lambda out: nn.functional.cross_entropy(out, y)


class MaskWrittenByFloats(nn.Module):
    """An integer mask made from constants (its value known), then written in place from a float comparison:
    the branch on it after cannot be known."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 10)

    def forward(self, x):
        keep = torch.ones(x.shape[0], dtype=torch.bool)
        if not keep.all():  # known: every entry is True
            raise AssertionError("the shadow of a constant mask was lost")
        keep &= x.sum((1, 2)) > 0
        if keep.all():  # a float decides it: unknowable
            x = x * 2
        return self.fc(x.mean(1))


def mask_written_by_floats(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return MaskWrittenByFloats(), x, lambda out: nn.functional.cross_entropy(out, y)


class InplaceOnViews(nn.Module):
    """In-place writes on views whose base requires grad: the ReLU on the (1, h, w, 512) view F.linear returns for
    a 4-D input (Swinv2's continuous position bias MLP), and an in-place dropout on a flattened pooled output
    (MobileNetV1's classifier)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, 256), nn.ReLU(inplace=True), nn.Linear(256, 4, bias=False))
        self.register_buffer("coords", torch.stack(torch.meshgrid(torch.arange(7.0), torch.arange(7.0),
                                                                  indexing="ij")).permute(1, 2, 0)[None].contiguous())
        self.fc = nn.Linear(dim, 49 * 4)
        self.dropout = nn.Dropout(0.2, inplace=True)
        self.head = nn.Linear(49 * 4, 10)

    def forward(self, x):
        bias = self.mlp(self.coords).view(-1)
        h = self.fc(x.mean(1)) + bias
        return self.head(self.dropout(torch.flatten(h.view(h.shape[0], 49, 4), 1)))


def inplace_on_views(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return InplaceOnViews(), x, lambda out: nn.functional.cross_entropy(out, y)


class TransposedNorm(nn.Module):
    """A LayerNorm whose output gradient arrives transposed (Swin's pooler: `AdaptiveAvgPool1d` over
    `sequence_output.transpose(1, 2)`): the CPU kernel's grad_input is contiguous, so the Linear before the norm
    takes it as a view, never a copy."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        h = self.norm(self.fc(x.repeat(1, 8, 1)))  # the tokens x 8: the norm's gradient is the peak's
        return self.head(torch.flatten(self.pool(h.transpose(1, 2)), 1))


def transposed_norm(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return TransposedNorm(), x, lambda out: nn.functional.cross_entropy(out, y)


_CACHE_HITS: list = []


class Memoised(nn.Module):
    """A forward that memoises a tensor built from sizes alone (transformers' BEiT relative position index, an
    `lru_cache` on a static method)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.zeros(64, 1))
        self.head = nn.Linear(dim, 10)

    @staticmethod
    def index(n: int) -> torch.Tensor:
        return _index(n)

    def forward(self, x):
        bias = self.table[self.index(x.shape[1])]  # (tokens, 1)
        return self.head((self.fc(x) + bias).mean(1))


def _make_index(n: int) -> torch.Tensor:
    _CACHE_HITS.append(n)
    return torch.arange(n) % 64


import functools  # noqa: E402

_index = functools.lru_cache(maxsize=4)(_make_index)


def memoised(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return Memoised(), x, lambda out: nn.functional.cross_entropy(out, y)


class KnownMasks(nn.Module):
    """Output shapes decided by masks made from constants (their values known): a boolean index (SpecAugment's
    `hidden_states[mask] = masked_spec_embed`), `masked_select` on integers (CTC's `labels.masked_select`)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.fill = nn.Parameter(torch.zeros(dim))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        mask = torch.arange(x.shape[1]) % 3 == 0
        picked = self.fc(x)[:, mask]
        h = self.fc2(x)
        h[:, mask] = self.fill
        kept = torch.arange(x.shape[1]).masked_select(mask)
        return self.head(picked.mean(1) + h.mean(1) + kept.float().mean())


def known_masks(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return KnownMasks(), x, lambda out: nn.functional.cross_entropy(out, y)


class MaskFromFloats(nn.Module):
    """An output shape that depends on float values: no trace knows it."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 10)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0].sum() + h.mean((1,)) * 0


def mask_from_floats(micro_batch: int = 4, seq_len: int = 16):
    x, y = _batch(micro_batch, seq_len)
    return MaskFromFloats(), x, lambda out: nn.functional.cross_entropy(out, y)
