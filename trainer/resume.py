"""Resume: find the newest complete checkpoint (rank 0 verifies it and reads it once; each other rank reads it once)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint as ckpt
from trainer.config import Config
from trainer.dist import on_main, say
from trainer.env import DistEnv
from trainer.errors import UserError
from trainer.sharded import EXTRA


@dataclass
class Resumed:
    """A checkpoint chosen for this run, with its state as read from disk."""

    path: Path
    state: dict[str, Any]


def find(cfg: Config, env: DistEnv, run_dir: Path) -> Resumed | None:
    """The checkpoint ``checkpoint.resume`` points to (the run's own newest one wins), or None."""
    if cfg.checkpoint.resume == "never":
        return None
    explicit = None if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)
    verified: dict[str, Any] = {}

    def pick() -> str | None:
        # The run's own newest checkpoint wins: a requeued job that was started from PATH continues
        # from where it got to, not from PATH again.
        for target in [run_dir, *([explicit] if explicit else [])]:
            try:
                found = ckpt.find_resumable(target)
            except Exception as exc:
                raise UserError("checkpoint.resume", f"cannot read {str(target)!r} ({exc})",
                                "pass a checkpoint file or run folder written by this trainer") from None
            if found:
                verified["state"] = found[1]  # rank 0 read the file once to verify it: that read is the load
                return str(found[0])
        if explicit:
            raise UserError("checkpoint.resume", f"no complete checkpoint in {str(explicit)!r}",
                            "pass a step_*.pt file or step_* folder with its .json manifest, or a run folder holding "
                            "checkpoints/")
        return None

    # Rank 0 picks (and verifies) the checkpoint, so warnings appear once and all ranks load the same one.
    chosen = on_main(env, pick)
    if chosen is None:
        return None
    # A sharded checkpoint is a folder: here its small extra.pt; models and optimizers load collectively later.
    source = Path(chosen) / EXTRA if Path(chosen).is_dir() else chosen
    state = verified.get("state") or torch.load(source, map_location="cpu", weights_only=True)
    return Resumed(Path(chosen), state)


def notes(cfg: Config, env: DistEnv, state: dict[str, Any], record: dict[str, Any]) -> None:
    """Say what differs from the run that wrote the checkpoint: training goes on, but not as it would have."""
    for group, key in (("data", "name"), ("data", "batch_size"), ("optim", "grad_accum"), ("train", "seed")):
        was, now = state["config"][group][key], getattr(getattr(cfg, group), key)
        if was != now:
            say(env, f"note: {group}.{key} was {was!r} in the checkpoint, now {now!r}: training continues, "
                     "but not as the original run would")
    for group, now in record.items():
        was = state.get("meta", {}).get("plugins", {}).get(group)
        if was and (was["target"], was["kwargs"]) != (now["target"], now["kwargs"]):
            say(env, f"note: {group} was {was['target']} {was['kwargs']} in the checkpoint, now {now['target']} "
                     f"{now['kwargs']}")
