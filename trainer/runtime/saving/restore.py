"""What a run continues from, loaded into the objects a loop restores: the newest memory snapshot the nodes of this
attempt hold (a restart inside the allocation), else the run's newest durable checkpoint, else nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from trainer.checkpoint.resume import Resumed, durable_step, find
from trainer.checkpoint.state import restore_objects
from trainer.core.env import DistEnv
from trainer.core.schema import Config
from trainer.data.loader import Loader
from trainer.runtime.saving.snapshots import Snapshots


@dataclass
class Resumption:
    """The checkpoint a run continued from (None: a fresh start), the step, and how the restore went."""

    resumed: Resumed | None = None
    step: int = 0
    run_id: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    """For the attempt event: seconds the restore took, from where (memory, disk), bytes fetched from other nodes."""


def restore_point(cfg: Config, env: DistEnv, run_dir: Path, snapshots: Snapshots | None) -> Resumed | None:
    """Collective: the newest memory snapshot the nodes of this attempt hold together when it is newer than the
    run's newest durable checkpoint (nothing read from the shared file system), else that checkpoint, else None."""
    if snapshots is not None and cfg.checkpoint.resume != "never":
        got = snapshots.store.newest(durable_step(cfg, env, run_dir))
        if got is not None:
            snapshots.fetched = got.fetched
            return Resumed(got.path, got.state, memory=True)
    return find(cfg, env, run_dir)


def resume(cfg: Config, env: DistEnv, run_dir: Path, snapshots: Snapshots | None, objects: dict[str, Any],
           model: nn.Module | None, say: Callable[[str], None]) -> Resumption:
    """Collective: find what to continue from and load it into ``objects``."""
    began = time.perf_counter()
    resumed = restore_point(cfg, env, run_dir, snapshots)
    out = Resumption(resumed)
    if resumed:
        loaders = {n: o for n, o in objects.items() if isinstance(o, Loader)}
        exact = bool(loaders) and all(o.exact_after(resumed.state.get(n, {})) for n, o in loaders.items())
        restore_objects(resumed, objects, env, model, say, exact)
        out.step = int(resumed.state["step"])
        out.run_id = resumed.state.get("tracking", {}).get("run_id")
    out.facts = {"restore_s": round(time.perf_counter() - began, 3),
                 "restored_from": None if not resumed else "memory" if resumed.memory else "disk",
                 "fetched_bytes": snapshots.fetched if snapshots and resumed and resumed.memory else 0}
    return out
