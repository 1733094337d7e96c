"""Models: the tutorials' small CNN and torchvision's resnet18."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig


class SmallCNN(nn.Module):
    """Two 3×3 convs (in→10→10) with 2×2 pooling, then one linear layer to the classes (490→10 at 28 px)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, 3, padding=1)
        self.conv2 = nn.Conv2d(10, 10, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(10 * (image_size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        # No ReLU on the logits: it would clip every negative class score to zero.
        return self.fc1(torch.flatten(x, 1))


def build_model(cfg: ModelConfig, in_channels: int, image_size: int) -> nn.Module:
    """The configured network for images of ``in_channels`` × ``image_size``²."""
    if cfg.name == "cnn":
        return SmallCNN(in_channels, cfg.num_classes, image_size)
    import torchvision  # only here: the small CNN runs on images that ship torch alone

    model = torchvision.models.resnet18(weights=None, num_classes=cfg.num_classes)
    if cfg.small_input_stem:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
    return model
