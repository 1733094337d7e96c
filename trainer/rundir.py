"""The run folder and its files: config.yaml, result.json and the requeue marker. Rank 0 writes; all ranks know the path."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from trainer.dist import on_main, say
from trainer.env import DistEnv
from trainer.errors import UserError
from trainer.files import write_atomic, write_json
from trainer.heartbeat import HANG_FOLDER, set_aside

REQUEUE_MARKER = "requeue.json"
"""Left by rank 0 after a preemption save, for launchers that cannot see the exit code (torchrun's agent)."""


class RunDir:
    """``run.dir``, or ``runs/<Slurm job id>`` (a requeued job finds its folder again), else ``runs/<time stamp>``."""

    def __init__(self, path: Path, env: DistEnv) -> None:
        self.path, self.env = path, env

    @classmethod
    def open(cls, env: DistEnv, wanted: str | None, config_yaml: str) -> RunDir:
        """Decide and create the folder on rank 0, write the config, clear an earlier attempt's marker."""

        def make() -> str:
            if wanted:
                path = Path(wanted).resolve()
            else:
                path = Path("runs", env.job_id or datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
                if not env.job_id and path.exists():
                    path = Path(f"{path}-{time.time_ns() % 10**6}")
            try:
                path.mkdir(parents=True, exist_ok=True)
                write_atomic(path / "config.yaml", config_yaml)
                (path / REQUEUE_MARKER).unlink(missing_ok=True)
                # Before the broadcast below, so before any rank's watchdog: an earlier attempt's files would
                # complete rank 0's wait for every rank at once and hand the other ranks a stale report.
                moved = set_aside(path / HANG_FOLDER)
                if moved:
                    say(env, f"note: the previous attempt's hang diagnostics were moved to {moved}")
            except OSError as exc:
                raise UserError("run.dir", f"cannot write {str(path)!r} ({exc.strerror})",
                                "choose a folder this user can write, on storage every node shares") from None
            return str(path)

        return cls(Path(on_main(env, make)), env)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def hang(self) -> Path:
        return self.path / HANG_FOLDER

    def write_result(self, result: dict[str, Any]) -> None:
        """The run's summary (rank 0)."""
        if self.env.is_main:
            write_json(self.path / "result.json", result)

    def mark_requeue(self, marker: dict[str, Any]) -> None:
        """Ask the launcher to requeue (rank 0): the batch script reads this when it cannot see exit code 75."""
        if self.env.is_main:
            write_atomic(self.path / REQUEUE_MARKER, json.dumps(marker))
