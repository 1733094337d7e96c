"""The one home for writing files atomically and for reading YAML with errors a user can act on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.core.errors import UserError


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (the folder's entry, not only the file's bytes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path: Path) -> Path:
    """The hidden temporary name a file is written under before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp")


def write_atomic(path: Path, data: bytes | str, durable: bool = True) -> None:
    """Write ``data`` so that ``path`` holds either its old content or all of the new one.

    ``durable`` also fsyncs the file and its folder (what a commit needs); without it a reader never sees a
    half-written file, but a power cut may lose the new content (hang reports: a dead disk must not block them).
    """
    tmp = tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def write_json(path: Path, data: Any, durable: bool = True) -> None:
    """:func:`write_atomic` of ``data`` as indented JSON."""
    write_atomic(path, json.dumps(data, indent=1) + "\n", durable)


def move_aside(folder: Path, name: str) -> Path:
    """Rename ``folder`` to ``name`` beside it, or ``name-2``, ``name-3`` … where taken (kept, never overwritten)."""
    target, n = folder.with_name(name), 1
    while target.exists():  # two set aside in the same second
        n += 1
        target = folder.with_name(f"{name}-{n}")
    folder.rename(target)
    return target


def load_yaml(path: Path, field: str, hint: str) -> DictConfig:
    """A YAML file that must hold a mapping; a missing file, bad syntax or another shape is a UserError on ``field``."""
    if not path.is_file():
        raise UserError(field, f"file {str(path)!r} does not exist", hint)
    try:
        loaded = OmegaConf.load(path)
    except Exception as exc:  # yaml's parser errors are many classes
        raise UserError(field, f"{str(path)!r} is not valid YAML ({str(exc).splitlines()[0]})",
                        "fix the YAML syntax") from None
    if not isinstance(loaded, DictConfig):
        raise UserError(field, f"{str(path)!r} must hold a mapping of keys", "write it as `key: value` lines")
    return loaded
