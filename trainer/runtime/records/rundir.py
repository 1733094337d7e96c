"""The run folder and its files: config.yaml, result.json, the requeue marker and the report. Rank 0 writes; all ranks
know the path."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from trainer.core.dist import on_main, say
from trainer.core.env import DistEnv, default_run_dir
from trainer.core.errors import UserError
from trainer.core.files import write_atomic, write_json
from trainer.core.records import REQUEUE_MARKER, RequeueMarker
from trainer.runtime.health.heartbeat import hang_folders, set_aside
from trainer.runtime.records.attempts import attempts, figures, summary


class RunDir:
    """``run.dir``, or ``runs/<Slurm job id>`` (a requeued job finds its folder again), else ``runs/<time stamp>``."""

    def __init__(self, path: Path, env: DistEnv) -> None:
        self.path, self.env = path, env

    @classmethod
    def decide(cls, env: DistEnv, wanted: str | None) -> RunDir:
        """Collective: the folder, as rank 0 decides it; nothing is written yet (see ``create``)."""

        def choose() -> str:
            if wanted:
                return str(Path(wanted).resolve())
            path = Path(default_run_dir(env.job_id or datetime.now().strftime("%Y%m%d-%H%M%S"))).resolve()
            return f"{path}-{time.time_ns() % 10**6}" if not env.job_id and path.exists() else str(path)

        return cls(Path(on_main(env.is_main, choose)), env)

    def create(self, config_yaml: str) -> None:
        """Collective: rank 0 creates the folder, writes the config and clears an earlier attempt's marker."""

        def make() -> str:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                write_atomic(self.path / "config.yaml", config_yaml)
                (self.path / REQUEUE_MARKER).unlink(missing_ok=True)
                # Before the broadcast below, so before any rank's watchdog: an earlier attempt's files would
                # complete rank 0's wait for every rank at once and hand the other ranks a stale report.
                # Every generation's folder (hang-k after the k-th regroup): the next attempt's regroups count from 1.
                for folder in hang_folders(self.path):
                    if moved := set_aside(folder):
                        say(self.env, f"note: the previous attempt's hang diagnostics were moved to {moved}")
            except OSError as exc:
                raise UserError("run.dir", f"cannot write {str(self.path)!r} ({exc.strerror})",
                                "choose a folder this user can write, on storage every node shares") from None
            return str(self.path)

        on_main(self.env.is_main, make)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_result(self, result: dict[str, Any]) -> None:
        """The run's summary (rank 0)."""
        if self.env.is_main:
            write_json(self.path / "result.json", result)

    def mark_requeue(self, marker: RequeueMarker) -> None:
        """Ask the launcher to requeue (rank 0): the batch script reads this when it cannot see exit code 75."""
        if self.env.is_main:
            marker.write(self.path)

    def write_report(self, page: bool = True) -> dict[str, float]:
        """At the end of a run (rank 0): the report page (``page``), made by the report tool as its own program (the
        runtime never imports the tools), or one line saying why not; never fails the run. Returns the goodput
        figures."""
        if not self.env.is_main:
            return {}
        if not page:
            return self._goodput()
        package_root = str(Path(__file__).resolve().parents[2])  # importable even where the user's script added it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run([sys.executable, "-m", "trainer.report", "--end-of-run", str(self.path)], env=env,
                                  capture_output=True, text=True, timeout=300, check=False)
            say(self.env, done.stdout.strip() or f"note: no run report ({(done.stderr.strip().splitlines() or ['?'])[-1]})")
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            say(self.env, f"note: no run report ({type(exc).__name__}: {exc})")
            return {}
        return self._goodput()

    def _goodput(self) -> dict[str, float]:
        try:
            runs = attempts(self.path)
            return summary(figures(runs)) if runs else {}
        except Exception as exc:  # noqa: BLE001 - a bug in the figures never fails the run they describe
            say(self.env, f"note: no run summary ({type(exc).__name__}: {exc})")
            return {}
