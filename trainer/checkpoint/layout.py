"""What a checkpoint folder holds, for both formats: ``step_<N>.pt`` (one file) or ``step_<N>/`` (DCP shards plus
``extra.pt``), each counted only once its manifest ``step_<N>.json`` exists; the ``latest`` pointer; verification
against the manifest; finding the newest complete checkpoint."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import xxhash

from trainer.core.files import write_json

PREFIX = "step_"
FORMAT_VERSION = 2
EXTRA = "extra.pt"
"""A sharded checkpoint's non-sharded state (step, loaders, schedulers, random generators), written by rank 0."""


def committed(folder: Path) -> list[Path]:
    """Manifests of committed checkpoints, newest first."""
    return sorted(folder.glob(f"{PREFIX}*.json"), key=lambda p: p.name, reverse=True)


def latest(folder: Path) -> Path | None:
    """The newest committed checkpoint (a file or a step folder), or None."""
    manifests = committed(folder)
    return manifests[0].with_suffix("") if manifests and manifests[0].with_suffix("").is_dir() else (
        manifests[0].with_suffix(".pt") if manifests else None)


def publish(folder: Path, final: Path, step: int, keep: int, **manifest: Any) -> None:
    """Commit ``final``: its manifest (the commit point, fsynced with the folder), the ``latest`` pointer, then prune
    to the newest ``keep`` up to ``final``."""
    write_json(final.with_suffix(".json"), {**manifest, "global_step": step, "time": time.time(),
                                            "version": FORMAT_VERSION})
    # A pointer for people and tools; resuming trusts the manifests, so it needs no fsync of its own.
    pointer = folder / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, folder / "latest")
    prune(folder, keep, final)


def prune(folder: Path, keep: int, published: Path | None = None) -> None:
    """Remove committed checkpoints beyond the newest ``keep`` (the manifest first: a half-pruned one never counts),
    and single files older than every committed one that never got a manifest (saves killed half-way).

    ``published``: the checkpoint just committed, which the run continues from: it ranks first and stays. Steps past
    it are left alone: the run went back to an older checkpoint (the newer ones failed verification, or were never
    loaded), so ranking them first would delete each new save as it is made; the run's own saves replace them as it
    reaches their steps again."""
    ranked = committed(folder)
    if published is not None:
        mine = published.with_suffix(".json")
        ranked = [mine, *(m for m in ranked if m.name < mine.name)]  # zero-padded steps: names sort as steps
    for manifest in ranked[max(keep, 1 if published else 0):]:
        manifest.unlink(missing_ok=True)
        step_dir = manifest.with_suffix("")
        if step_dir.is_dir():
            shutil.rmtree(step_dir, ignore_errors=True)
        manifest.with_suffix(".pt").unlink(missing_ok=True)
    marked = {m.with_suffix(".pt") for m in committed(folder)}
    oldest = min((p.stat().st_mtime for p in marked if p.exists()), default=None)
    for orphan in folder.glob(f"{PREFIX}*.pt"):
        if orphan not in marked and oldest is not None and orphan.stat().st_mtime < oldest:
            orphan.unlink(missing_ok=True)


def verify(manifest: Path) -> bytes:
    """The checkpoint's bytes if they match its manifest; raise ValueError otherwise."""
    meta = json.loads(manifest.read_text())
    data = (manifest.parent / meta["file"]).read_bytes()
    if len(data) != meta["size"]:
        raise ValueError(f"size {len(data)} != {meta['size']} recorded (truncated)")
    if xxhash.xxh3_64_hexdigest(data) != meta["xxh3_64"]:
        raise ValueError("checksum mismatch (corrupted)")
    return data


def verify_files(manifest: dict[str, Any], folder: Path) -> None:
    """Raise ValueError when a file of a committed step folder is missing or has another size (truncated)."""
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if path.stat().st_size != size:
            raise ValueError(f"{name} has {path.stat().st_size} bytes, {size} recorded (truncated)")


def find_resumable(target: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest complete checkpoint under a run folder or checkpoint folder, or the given file or step folder.
    A sharded checkpoint (a ``step_<N>/`` folder) comes back as the folder and its ``extra.pt`` state; its
    models and optimizers are loaded by every rank with :func:`trainer.checkpoint.sharded.load_sharded`."""
    if target.is_file() or (target.is_dir() and target.name.startswith(PREFIX)):
        manifest = target.with_suffix(".json")
        candidates = [manifest] if manifest.exists() else []
        if not candidates and target.is_file():
            return target, torch.load(target, map_location="cpu", weights_only=True)
    else:
        folder = target / "checkpoints" if (target / "checkpoints").is_dir() else target
        candidates = committed(folder)
    for manifest in candidates:
        meta = json.loads(manifest.read_text())
        if meta.get("format") == "dcp":
            step_dir = manifest.parent / meta["dir"]
            try:
                verify_files(meta, step_dir)
            except ValueError as exc:
                warnings.warn(f"skipping checkpoint {step_dir}: {exc}; trying an older one", stacklevel=2)
                continue
            return step_dir, torch.load(step_dir / EXTRA, map_location="cpu", weights_only=True)
        try:
            data = verify(manifest)
        except Exception as exc:
            bad = manifest.with_suffix(".pt")
            warnings.warn(f"skipping checkpoint {bad}: {exc}; trying an older one", stacklevel=2)
            continue
        # Intact bytes that do not load are no corruption: skipping them would restart the run from scratch.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return manifest.with_suffix(".pt"), state
    return None
