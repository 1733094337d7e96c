"""Write byte shards of Python's own standard library source for the char LM (no download).

    python examples/char_lm/make_shards.py DIR [--shards 8]
    python examples/char_lm/train.py --shards DIR

Each shard is a flat ``.bin`` file of bytes (one token per byte, as nanoGPT writes token files): DIR/train-NNN.bin
from many modules, DIR/val-000.bin from others. trainer.Shards reads them with ``Tokens(block, dtype="uint8")``.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path


def sources() -> list[Path]:
    """The standard library's own .py files, in a fixed order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--shards", type=int, default=8, help="training shards")
    p.add_argument("--shard-bytes", type=int, default=200_000, help="bytes per shard (about)")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    files, shard, written = sources(), bytearray(), 0
    for f in files:
        shard += f.read_bytes()
        if len(shard) >= args.shard_bytes:
            name = f"train-{written:03d}.bin" if written < args.shards else "val-000.bin"
            (args.dir / name).write_bytes(bytes(shard[: args.shard_bytes]))
            shard, written = bytearray(), written + 1
            if written > args.shards:
                break
    print(f"{written - 1} training shards and 1 validation shard of {args.shard_bytes:,} bytes in {args.dir}")


if __name__ == "__main__":
    main()
