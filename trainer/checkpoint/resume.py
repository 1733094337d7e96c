"""Resume: find the newest complete checkpoint (rank 0 verifies it and reads it once; each other rank reads it once)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.layout import EXTRA, committed, find_resumable
from trainer.core.dist import on_main
from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.core.exits import attempt_id
from trainer.core.files import move_aside
from trainer.core.schema import Config


@dataclass
class Resumed:
    """A checkpoint chosen for this run, with its state as read from disk."""

    path: Path
    state: dict[str, Any]
    memory: bool = False
    """A snapshot in node memory (trainer.checkpoint.memory), not a durable checkpoint."""


def continuing(cfg: Config) -> Config:
    """``cfg`` with ``checkpoint.resume=never`` read as ``auto``: what a recovery inside a run loads from."""
    if cfg.checkpoint.resume != "never":
        return cfg
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))


def for_this_start(cfg: Config, env: DistEnv) -> Config:
    """``checkpoint.resume=never`` starts a job afresh once: its later attempts (a requeue, a restart inside the
    allocation, torchrun's agent starting it again) continue the checkpoints its first one wrote."""
    return cfg if attempt_id() == "0" and env.agent_restart == 0 else continuing(cfg)


def durable_step(cfg: Config, env: DistEnv, run_dir: Path) -> int:
    """Collective: the step of the run's newest committed checkpoint (-1: none, or checkpoint.resume=never), from
    its manifests alone (nothing is loaded)."""
    if cfg.checkpoint.resume == "never":
        return -1

    def newest() -> int:
        for manifest in committed(run_dir / "checkpoints"):
            try:
                return int(json.loads(manifest.read_text())["global_step"])
            except (OSError, ValueError, KeyError):
                continue
        return -1

    return int(on_main(env.is_main, newest))


def find(cfg: Config, env: DistEnv, run_dir: Path) -> Resumed | None:
    """The checkpoint ``checkpoint.resume`` points to (the run's own newest one wins), or None. ``never`` in a folder
    holding checkpoints sets them aside first: a later resume must continue this run, not the older one."""
    if cfg.checkpoint.resume == "never":
        on_main(env.is_main, lambda: _set_aside(run_dir / "checkpoints"))
        return None
    explicit = None if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)
    verified: dict[str, Any] = {}

    def pick() -> str | None:
        # The run's own newest checkpoint wins: a requeued job that was started from PATH continues
        # from where it got to, not from PATH again.
        for target in [run_dir, *([explicit] if explicit else [])]:
            try:
                found = find_resumable(target)
            except Exception as exc:
                raise UserError("checkpoint.resume", f"cannot read {str(target)!r} ({exc})",
                                "pass a checkpoint file or run folder written by this trainer") from None
            if found:
                verified["state"] = found[1]  # rank 0 read the file once to verify it: that read is the load
                if explicit and target == run_dir:
                    print(f"note: checkpoint.resume={explicit} is where this run started; it continues from its own "
                          f"{found[0].name} (to start from {explicit.name} again, use another run.dir)", flush=True)
                return str(found[0])
        if explicit:
            raise UserError("checkpoint.resume", f"no complete checkpoint in {str(explicit)!r}",
                            "pass a step_*.pt file or step_* folder with its .json manifest, or a run folder holding "
                            "checkpoints/")
        return None

    # Rank 0 picks (and verifies) the checkpoint, so warnings appear once and all ranks load the same one.
    chosen = on_main(env.is_main, pick)
    if chosen is None:
        return None
    # A sharded checkpoint is a folder: here its small extra.pt; models and optimizers load collectively later.
    source = Path(chosen) / EXTRA if Path(chosen).is_dir() else chosen
    state = verified.get("state") or torch.load(source, map_location="cpu", weights_only=True)
    return Resumed(Path(chosen), state)



def _set_aside(folder: Path) -> None:
    """Move a run folder's checkpoints aside (renamed, never deleted) before a run that starts afresh in it."""
    if not committed(folder):
        return
    aside = move_aside(folder, f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"note: checkpoint.resume=never: this folder's checkpoints are set aside in {aside}, so that a later resume "
          "continues this run, not that one", flush=True)
