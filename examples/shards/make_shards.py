"""Write a WebDataset-style shard folder of labelled images and train the built-in trainer on it (no download).

    python examples/shards/make_shards.py /tmp/wds
    python -m trainer data.name=shards data.root=/tmp/wds

DIR/train/shard-NNN.tar and DIR/val/shard-NNN.tar hold samples ``<key>.png`` (a grey image, 28 px by default: a smooth template
per class plus noise) and ``<key>.cls`` (its class), as webdataset's ShardWriter lays them out. The built-in trainer
reads them through trainer.Shards; any program can read them with webdataset too.
"""

from __future__ import annotations

import argparse
import io
import tarfile
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image


def images(n: int, classes: int, gen: torch.Generator, templates: torch.Tensor) -> list[tuple[bytes, int]]:
    """``n`` PNG images with their classes."""
    if not n:
        return []
    labels = torch.randint(0, classes, (n,), generator=gen)
    size = templates.shape[-1]
    pixels = templates[labels] + 0.6 * torch.randn(n, size, size, generator=gen)
    pixels = ((pixels - pixels.min()) / (pixels.max() - pixels.min()) * 255).to(torch.uint8)
    out = []
    for image, label in zip(pixels, labels.tolist(), strict=True):
        buf = io.BytesIO()
        Image.fromarray(image.numpy(), mode="L").save(buf, format="PNG")
        out.append((buf.getvalue(), label))
    return out


def write_shards(folder: Path, samples: list[tuple[bytes, int]], per_shard: int, prefix: str) -> int:
    if samples:
        folder.mkdir(parents=True, exist_ok=True)
    for k in range(0, len(samples), per_shard):
        with tarfile.open(folder / f"shard-{k // per_shard:03d}.tar", "w") as tar:
            for i, (png, label) in enumerate(samples[k:k + per_shard], start=k):
                for ext, data in (("png", png), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{prefix}{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return -(-len(samples) // per_shard)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--train", type=int, default=1024, help="training samples")
    p.add_argument("--val", type=int, default=256, help="validation samples")
    p.add_argument("--per-shard", type=int, default=128, help="samples per shard")
    p.add_argument("--size", type=int, default=28, help="image side in pixels")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    templates = F.interpolate(torch.randn(10, 1, 7, 7, generator=gen), size=(args.size, args.size), mode="bilinear")[:, 0]
    train = write_shards(args.dir / "train", images(args.train, 10, gen, templates), args.per_shard, "train")
    val = write_shards(args.dir / "val", images(args.val, 10, gen, templates), args.per_shard, "val")
    print(f"{train} train and {val} val shards of {args.per_shard} samples in {args.dir}")


if __name__ == "__main__":
    main()
