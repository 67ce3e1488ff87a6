"""A small CNN with BatchNorm for peakledger's traced describer (`--module examples/modules/cnn.py:factory`).

Two conv -> BatchNorm -> ReLU -> max-pool blocks and a linear head on 32x32 RGB images (10 classes),
trained with cross-entropy. `factory(micro_batch=...)` returns (model, batch, loss_fn): the batch is
(images, labels) and the model returns the loss (`loss_fn` passes it on), so the labels are a batch
tensor like the images rather than a tensor the loss closes over.
"""

import torch
import torch.nn.functional as F
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 3, width: int = 32, classes: int = 10, image: int = 32):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(channels, width), block(width, 2 * width))
        self.head = nn.Linear(2 * width * (image // 4) ** 2, classes)

    def forward(self, images, labels):
        return F.cross_entropy(self.head(self.features(images).flatten(1)), labels)


def factory(micro_batch: int = 8):
    model = SmallCNN()
    images = torch.randn(micro_batch, 3, 32, 32)
    labels = torch.randint(0, 10, (micro_batch,))
    return model, (images, labels), lambda loss: loss
