"""Models: the tutorials' small CNN, every torchvision classification model by name, or the user's by import path."""

from __future__ import annotations

import difflib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.builtin import targets as plugins
from trainer.core.errors import UserError
from trainer.core.schema import ModelConfig


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


def torchvision_names() -> list[str]:
    """Every classification model torchvision builds by name (detection, video, … are not image classifiers)."""
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def _first_conv(model: nn.Module) -> tuple[nn.Module, str, nn.Conv2d] | None:
    """The first Conv2d in definition order, with its parent and attribute name (to replace it)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            parent_name, _, attr = name.rpartition(".")
            return model.get_submodule(parent_name), attr, module
    return None


def _like(conv: nn.Conv2d, in_channels: int, kernel: int | None = None) -> nn.Conv2d:
    k = kernel or conv.kernel_size[0]
    stride, padding = (1, k // 2) if kernel else (conv.stride, conv.padding)
    return nn.Conv2d(in_channels, conv.out_channels, k, stride, padding,  # type: ignore[arg-type]
                     groups=1, bias=conv.bias is not None)


def torchvision_model(cfg: ModelConfig, in_channels: int, image_size: int) -> nn.Module:
    """torchvision's ``cfg.name`` (untrained) with its stem fitted to ``in_channels`` and, optionally, small images."""
    import torchvision

    names = torchvision_names()
    if cfg.name not in names:
        close = difflib.get_close_matches(cfg.name, names, n=4)
        raise UserError("model.name", f"unknown model {cfg.name!r}",
                        f"did you mean {', '.join(close)}?" if close else
                        "use cnn, a torchvision classification model (resnet18, vgg16, …) or model.target=pkg.mod:Net")
    kwargs = dict(cfg.kwargs)
    if cfg.name in ("googlenet", "inception_v3"):
        kwargs.setdefault("aux_logits", False)  # auxiliary heads make training outputs tuples, not logits
    try:
        model: nn.Module = torchvision.models.get_model(cfg.name, weights=None, num_classes=cfg.num_classes, **kwargs)
    except TypeError as exc:
        raise UserError("model.kwargs", f"torchvision's {cfg.name} rejects these arguments ({exc})",
                        "remove them, or see torchvision's documentation of the model") from None
    small = cfg.small_input_stem and image_size < 64
    found = _first_conv(model)
    if found is not None:
        parent, attr, conv = found
        if small and cfg.name.startswith(("resnet", "resnext", "wide_resnet")):
            setattr(parent, attr, _like(conv, in_channels, kernel=3))  # 3×3 stride 1: the CIFAR-style stem
            model.maxpool = nn.Identity()
        elif conv.in_channels != in_channels:
            setattr(parent, attr, _like(conv, in_channels))
    if small and cfg.name.startswith("vgg"):
        features: nn.Sequential = model.features  # type: ignore[assignment]
        last = max(i for i, m in enumerate(features) if isinstance(m, nn.MaxPool2d))
        features[last] = nn.Identity()  # 28 px → 1 px after four pools; a fifth would leave nothing
    return model


def build_model(cfg: ModelConfig, in_channels: int, image_size: int) -> nn.Module:
    """The configured network: ``model.target`` when set, else the built-in ``model.name`` for these images."""
    if cfg.target:
        return plugins.build(cfg.target, cfg.kwargs, "model.target", (nn.Module,), "a torch.nn.Module")
    if cfg.name == "cnn":
        if image_size % 4:
            raise UserError("data.image_size", f"must be a multiple of 4 for the cnn, got {image_size}",
                            "e.g. data.image_size=28")
        return SmallCNN(in_channels, cfg.num_classes, image_size)
    return torchvision_model(cfg, in_channels, image_size)


def check_input(cfg: ModelConfig, in_channels: int, image_size: int, example: Any) -> None:
    """Run one sample through a built-in model built on the meta device (no memory, no compute): a shape error
    names the key instead of failing in the first step."""
    if cfg.target or cfg.name == "cnn" or not isinstance(example, torch.Tensor):
        return
    try:
        with torch.device("meta"), torch.no_grad():
            build_model(cfg, in_channels, image_size).eval()(example.to("meta")[None])
    except NotImplementedError:  # an operation the meta device lacks: the first real step will tell
        return
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise UserError("model.name", f"{cfg.name} cannot take {tuple(example.shape)} inputs: "
                        f"{(str(exc).splitlines() or [type(exc).__name__])[0]}",
                        "use images of at least 64 px (data.image_size, or resize them in your data set), or a model "
                        "that keeps small inputs: cnn, resnet18/50, vgg16, mobilenet_v3_small, efficientnet_b0") from None
