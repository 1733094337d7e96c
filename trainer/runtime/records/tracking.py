"""W&B run tracking from rank 0 only: one run per job across requeues, offline when nodes have no route out.

The run id is made once and kept in ``<run>/tracking.json`` and in every checkpoint; a resumed run
continues it with explicit steps (offline W&B restarts its own step counter), and steps already
logged before a crash are not logged twice. ``tracking.json`` is written when the run id is made, at every
checkpoint, at the end, and otherwise at most every ``STATE_EVERY_S`` while metrics are logged (not per metric: a
file write per log line is I/O the loop does not need). Any W&B failure is reported once and training goes on.
"""

from __future__ import annotations

import json
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer.core.env import DistEnv, JobInfo
from trainer.core.errors import at_exit
from trainer.core.files import write_json
from trainer.core.schema import Config
from trainer.runtime.records import wandb_folders

STATE_EVERY_S = 30.0
"""How stale the last logged step in tracking.json may grow while metrics are logged between checkpoints."""


def has_route(host: str = "api.wandb.ai", port: int = 443, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to W&B opens within ``timeout`` (DNS included; compute nodes often have none)."""
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)


def resolve_mode(mode: str, info: JobInfo) -> str:
    """online/offline/disabled; auto is offline without a key or a route to W&B."""
    if mode != "auto":
        return mode
    return "online" if info.wandb_key and has_route() else "offline"


class Tracker:
    """Logs to W&B on rank 0; on other ranks, when disabled, or after a W&B error, every call does nothing."""

    def __init__(self, cfg: Config, env: DistEnv, info: JobInfo, run_dir: Path) -> None:
        self.enabled = env.is_main and cfg.tracking.mode != "disabled"
        self.cfg, self.env, self.info, self.run_dir = cfg, env, info, run_dir
        self.state_file = run_dir / "tracking.json"
        self.run: Any = None
        self.run_id: str | None = None
        self.last_step = -1
        self.floor = -1
        self._saved_at = 0.0

    def start(self, config: dict[str, Any], run_id: str | None) -> None:
        """Open (or continue) the run; ``run_id`` comes from the checkpoint being resumed, if any."""
        if not self.enabled:
            return
        try:
            self._start(config, run_id)
        except Exception as exc:
            self._fail(exc)

    def _start(self, config: dict[str, Any], run_id: str | None) -> None:
        import wandb

        at_exit(wandb_folders.remove)  # its import made two folders in TMPDIR that os._exit would leave

        afresh = self.cfg.checkpoint.resume == "never"  # a new run in a used folder: not the old W&B run's steps
        saved = json.loads(self.state_file.read_text()) if self.state_file.exists() and not afresh else {}
        self.run_id = run_id or saved.get("run_id") or secrets.token_hex(6)  # W&B ids: lowercase letters and digits
        self.last_step = saved.get("last_step", -1) if saved.get("run_id") == self.run_id else -1
        self.floor = self.last_step  # logged by an earlier process: never again
        mode = resolve_mode(self.cfg.tracking.mode, self.info)
        t = self.cfg.tracking
        folder = Path(t.dir) if t.dir else self.run_dir
        folder.mkdir(parents=True, exist_ok=True)  # W&B itself would fall back to /tmp without a word
        tags = [*t.tags, f"nodes:{self.env.num_nodes}", f"procs:{self.env.world_size}"]
        if self.env.job_id:
            tags.append(f"slurm:{self.env.job_id}")
        if self.info.array_task_id is not None:
            tags.append(f"array:{self.info.array_task_id}")
        if self.info.gpus_on_node:
            tags.append(f"gpus_per_node:{self.info.gpus_on_node}")
        self.run = wandb.init(
            project=t.project, entity=t.entity, id=self.run_id, resume="allow", mode=mode,  # type: ignore[arg-type]
            dir=str(folder),
            name=self.cfg.run.name or self.info.trial or self.run_dir.name,
            group=t.group or (self.info.trial or "").rpartition("-")[0] or self.info.array_job_id or self.info.job_name,
            tags=tags, config=config, settings=wandb.Settings(silent=True),
        )
        self._save_state()
        where = f"{self.run.dir}" if mode == "offline" else self.run.url
        print(f"tracking: W&B {mode} run {self.run_id} ({where})"
              + ("; upload later with `make sync`" if mode == "offline" else ""), flush=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics at optimizer step ``step``; steps an earlier process already logged are skipped."""
        if self.run is None or step <= self.floor or step < self.last_step:
            return
        if self.last_step <= self.floor:  # this attempt's first row: its world size, a chart across attempts
            metrics = {**metrics, "world/processes": self.env.world_size, "world/nodes": self.env.num_nodes}
        try:
            self.run.log(metrics, step=step)
            self.last_step = step
            if time.monotonic() - self._saved_at > STATE_EVERY_S:
                self._save_state()
        except Exception as exc:
            self._fail(exc)

    def moved(self, env: DistEnv) -> None:
        """The group went on in place with ``env`` (a regroup: the next attempt): its first row gives the new size."""
        self.env, self.floor = env, self.last_step

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        """Write the final summary and close the run (``exit_code``: the process's, so W&B marks a failed run)."""
        if self.run is None:
            return
        try:
            if summary:
                self.run.summary.update(summary)
            self.run.finish(exit_code=exit_code)
            self._save_state()
        except Exception as exc:
            self._fail(exc)
        self.run = None

    def flush(self) -> None:
        """Record the last logged step now (at a checkpoint: a later attempt resumes from there)."""
        if self.run is not None:
            self._save_state()

    def _save_state(self) -> None:
        write_json(self.state_file, {"run_id": self.run_id, "last_step": self.last_step})
        self._saved_at = time.monotonic()

    def _fail(self, exc: Exception) -> None:
        print(f"warning: W&B tracking disabled after an error: {type(exc).__name__}: {exc}; training continues",
              file=sys.stderr, flush=True)
        self.enabled, self.run = False, None
