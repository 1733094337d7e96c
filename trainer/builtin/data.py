"""The built-in data sets: synthetic by default, MNIST/CIFAR-10/ImageFolder/WebDataset shards from a local path, or
``data.target``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset

from trainer.builtin import targets as plugins
from trainer.core.errors import UserError
from trainer.core.schema import Config
from trainer.data import ShardError, Shards
from trainer.data.loader import InMemory


@dataclass
class Data:
    """Train and evaluation sets, plus the image shape the built-in models must accept (when known)."""

    train: Dataset[Any]
    test: Dataset[Any] | None
    in_channels: int
    image_size: int

    @property
    def iterable(self) -> bool:
        """An IterableDataset: no sampler, no epoch length; each rank reads its own stream."""
        return isinstance(self.train, IterableDataset)


def synthetic(cfg: Config) -> Data:
    """Learnable, download-free images: a smooth template per class plus Gaussian noise, fixed by the seed."""
    d, size = cfg.data, cfg.data.image_size
    gen = torch.Generator().manual_seed(cfg.train.seed)
    # Smooth templates (upsampled 7×7 noise) give the convolutions spatial structure to find.
    templates = F.interpolate(torch.randn(cfg.model.num_classes, 1, 7, 7, generator=gen), size=(size, size),
                              mode="bilinear", align_corners=False)

    def make(n: int) -> InMemory:
        labels = torch.randint(0, cfg.model.num_classes, (n,), generator=gen)
        images = templates[labels] + d.synthetic_noise * torch.randn(n, 1, size, size, generator=gen)
        # Unit variance inputs whatever the noise level, so one learning rate suits every setting.
        images /= (templates.var() + d.synthetic_noise**2).sqrt()
        return InMemory(images, labels)

    return Data(make(d.synthetic_train_size), make(d.synthetic_test_size), 1, size)


def _missing(root: Path, what: str, expected: str, fetch: str) -> UserError:
    return UserError("data.root", f"no {what} under {str(root)!r} (expected {expected})",
                     f"download it where there is internet ({fetch}) and copy it there; "
                     "nothing is downloaded at run time")


def torchvision_data(cfg: Config) -> Data:
    """MNIST, CIFAR-10 or an ImageFolder tree read from ``data.root`` (never downloaded)."""
    import torchvision.datasets as tvd
    import torchvision.transforms as T

    root = Path(cfg.data.root or "")
    name = cfg.data.name
    if name == "mnist":
        if not (root / "MNIST" / "raw").is_dir():
            raise _missing(root, "MNIST", f"{root}/MNIST/raw/train-images-idx3-ubyte …",
                           f"python -c \"import torchvision; torchvision.datasets.MNIST('{root}', download=True)\"")
        tf = T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])
        return Data(tvd.MNIST(str(root), True, tf), tvd.MNIST(str(root), False, tf), 1, 28)
    if name == "cifar10":
        if not (root / "cifar-10-batches-py").is_dir():
            raise _missing(root, "CIFAR-10", f"{root}/cifar-10-batches-py/data_batch_1 …",
                           f"python -c \"import torchvision; torchvision.datasets.CIFAR10('{root}', download=True)\"")
        norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        test_tf = T.Compose([T.ToTensor(), norm])
        return Data(tvd.CIFAR10(str(root), True, train_tf), tvd.CIFAR10(str(root), False, test_tf), 3, 32)
    size = cfg.data.image_size
    if not (root / "train").is_dir() or not (root / "val").is_dir():
        raise _missing(root, "ImageFolder tree", f"{root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg",
                       "any tool that lays images out one folder per class")
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    test_tf = T.Compose([T.Resize(math.ceil(size * 8 / 7)), T.CenterCrop(size), T.ToTensor(), norm])
    train, test = tvd.ImageFolder(str(root / "train"), train_tf), tvd.ImageFolder(str(root / "val"), test_tf)
    if len(train.classes) != cfg.model.num_classes:
        found = len(train.classes)
        raise UserError("model.num_classes", f"is {cfg.model.num_classes} but {root}/train has {found} class folders",
                        f"pass model.num_classes={found}")
    return Data(train, test, 3, size)


IMAGE_KEYS = ("png", "jpg", "jpeg", "webp", "ppm", "npy", "pth")


def labelled_image(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """A decoded WebDataset sample as ``(image, label)``: its first image member, standardized, and its ``.cls``."""
    image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
    if image is None or "cls" not in sample:
        raise ShardError(f"sample {sample.get('__key__')!r} has members {sorted(k for k in sample if k != '__key__')}: "
                         f"data.name=shards needs an image ({', '.join(IMAGE_KEYS)}) and a .cls label",
                         "write shards with <key>.png and <key>.cls, or pass data.target for other samples")
    image = torch.as_tensor(image, dtype=torch.float32)
    return (image - image.mean()) / image.std().clamp_min(1e-6), int(sample["cls"])  # unit scale, as the synthetic set


def shards_data(cfg: Config) -> Data:
    """WebDataset tar shards of an image and a class label under ``data.root`` (its train/ and val/ if there)."""
    root = Path(cfg.data.root or "")
    split = (root / "train").is_dir()
    train = Shards(root / "train" if split else str(root), transform=labelled_image)
    test = Shards(root / "val", transform=labelled_image) if split and (root / "val").is_dir() else None
    return Data(train, test, *_image_shape(train))


def _is_data(obj: Any) -> bool:
    return isinstance(obj, (Dataset, IterableDataset)) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


def _image_shape(ds: Any) -> tuple[int, int]:
    """(channels, size) of a map-style set's first ``(image, label)`` sample; (3, 32) when it holds no image."""
    try:
        sample = ds[0] if not isinstance(ds, IterableDataset) else None
    except Exception:
        sample = None
    x = sample[0] if isinstance(sample, (tuple, list)) and sample else sample
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return int(x.shape[0]), int(x.shape[-1])
    return 3, 32


def user_data(cfg: Config) -> Data:
    """``data.target(**data.kwargs)``: a (train, eval) pair of data sets (eval may be None), or a Data."""

    def fits(obj: Any) -> bool:
        return isinstance(obj, Data) or (isinstance(obj, (tuple, list)) and len(obj) == 2 and _is_data(obj[0])
                                         and (obj[1] is None or _is_data(obj[1])))

    assert cfg.data.target
    out = plugins.build(cfg.data.target, cfg.data.kwargs, "data.target", fits,
                        "a (train, eval) pair of data sets (eval may be None)")
    if isinstance(out, Data):
        return out
    train, test = out
    return Data(train, test, *_image_shape(train))


def build_data(cfg: Config) -> Data:
    """The configured data: the user's ``data.target``, or a built-in set."""
    if cfg.data.target:
        data = user_data(cfg)
        if data.iterable and not cfg.train.max_steps:
            raise UserError("train.max_steps", "is required with an iterable data set (it has no epoch length)",
                            "e.g. train.max_steps=1000")
        return data
    if cfg.data.name == "shards":
        return shards_data(cfg)
    return synthetic(cfg) if cfg.data.name == "synthetic" else torchvision_data(cfg)
