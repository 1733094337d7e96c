"""Resume: find the newest complete checkpoint (rank 0 verifies it), read it once per rank, restore the state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer import checkpoint as ckpt
from trainer.config import Config
from trainer.dist import on_main, say
from trainer.env import DistEnv
from trainer.errors import UserError


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
                            "pass a step_*.pt file with its .json manifest, or a run folder holding checkpoints/")
        return None

    # Rank 0 picks (and verifies) the checkpoint, so warnings appear once and all ranks load the same one.
    chosen = on_main(env, pick)
    if chosen is None:
        return None
    state = verified.get("state") or torch.load(chosen, map_location="cpu", weights_only=True)
    return Resumed(Path(chosen), state)


def load_model(model: nn.Module, state: dict[str, Any], path: Path, record: dict[str, Any]) -> None:
    """Weights into ``model``; a checkpoint of another architecture is a UserError, not a key listing."""
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise UserError("checkpoint.resume", f"{path} does not fit the model {record['model']['target']} ({first})",
                        "resume with the model it was trained with, or start afresh: checkpoint.resume=never "
                        "or another run.dir") from None


def notes(cfg: Config, env: DistEnv, state: dict[str, Any], record: dict[str, Any]) -> None:
    """Say what differs from the run that wrote the checkpoint: training goes on, but not as it would have."""
    for group, key in (("data", "name"), ("data", "batch_size"), ("optim", "grad_accum"), ("train", "seed")):
        was, now = state["config"][group][key], getattr(getattr(cfg, group), key)
        if was != now:
            say(env, f"note: {group}.{key} was {was!r} in the checkpoint, now {now!r}: training continues, "
                     "but not as the original run would")
    for group, now in record.items():
        was = state.get("plugins", {}).get(group)
        if was and (was["target"], was["kwargs"]) != (now["target"], now["kwargs"]):
            say(env, f"note: {group} was {was['target']} {was['kwargs']} in the checkpoint, now {now['target']} "
                     f"{now['kwargs']}")


def restore_position(progress: ckpt.Progress, state: dict[str, Any], cfg: Config, env: DistEnv) -> bool:
    """Progress (converted to this world size) and this rank's generators; True when the resume is exact."""
    for k, v in state["progress"].items():
        setattr(progress, k, v)
    if state["world_size"] == env.world_size:
        ckpt.set_rng_state(state["rng"][env.rank])
        return True
    # batches_in_epoch counts per rank: convert through the samples the whole job consumed.
    consumed = progress.batches_in_epoch * state["config"]["data"]["batch_size"] * state["world_size"]
    progress.batches_in_epoch = consumed // (cfg.data.batch_size * env.world_size)
    say(env, f"note: checkpoint was written by {state['world_size']} processes, now {env.world_size}: the epoch "
             "continues after the samples already seen (to within one batch), but not bit-exactly")
    return False
