"""The ledger: one small JSON file per submission (job, sweep, trial) in the project's ``runs/ledger/``.

One file per submission, replaced atomically, because a shared file system makes one appended file or a local
SQLite unsafe (or split across login nodes). ``python -m cluster submit`` and ``sweep`` write a record when they
submit; a hand-run ``sbatch slurm/train.sbatch`` registers itself from its batch script
(``python -m cluster.job.ledger register``), which never replaces a record already there. Stdlib and torch-free
modules only, as the verdict: the batch shell may run it with the host's python3 beside a container.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from cluster.job import nodes
from trainer.core.events import git_commit

LEDGER_ENV = "TRAINER_LEDGER"
"""A folder to keep the ledger in instead of ``<project>/runs/ledger`` (tests, or a shared folder of your choice)."""

SCHEMA = 1
"""The records' layout. Records without ``schema`` were written before it and read the same way (their log layout
follows from their launcher); keys a newer version wrote are kept in ``extra`` and written back unchanged."""


@dataclass(frozen=True)
class Record:
    """One submission: a job, a sweep (its worker arrays) or one of a sweep's trials."""

    kind: str
    """``job``, ``sweep`` or ``trial``."""
    job_id: str
    """Slurm's job id; a sweep: its first worker array; a trial: its worker's array task (``12_3``)."""
    name: str
    run_dir: str = ""
    """The run's folder (a sweep: the sweep's folder)."""
    log: str = ""
    """The batch log (sbatch), the folder of the tasks' logs (submitit), or a sweep's log folder."""
    task_logs: bool = False
    """One log file per task (submitit's layout) instead of one batch log whose lines srun labels with the rank."""
    launcher: str = "sbatch"
    """What submitted it (``sbatch``, ``submitit``, ``sweep``): ``resubmit`` picks the same launcher."""
    key: str = ""
    """The record's file name when job ids are shared (a sweep's trials share their worker's)."""
    profile: str = ""
    nodes: str = ""
    """The node count or range asked for (``2``, ``1-3``)."""
    args: tuple[str, ...] = ()
    """The built-in trainer's overrides, or the command's words."""
    module: str | None = None
    command: tuple[str, ...] | None = None
    """A command's words (None: the built-in trainer)."""
    cluster: str | None = None
    """How it was asked for (``--cluster``, ``--set``, ``--nodes``), so that ``resubmit`` asks the same way."""
    sets: tuple[str, ...] = ()
    nodes_arg: str | None = None
    resubmit_of: str | None = None
    by_hand: bool = False
    """Registered by a hand-run batch script: its script is not known here."""
    arrays: tuple[str, ...] = ()
    """A sweep's worker arrays."""
    spec_file: str = ""
    sweep_dir: str = ""
    trial: int | None = None
    worker: int | None = None
    """A trial's worker (its array task index)."""
    params: Mapping[str, Any] = field(default_factory=dict)
    submitted_at: float = 0.0
    user: str = ""
    cwd: str = ""
    git: str | None = None
    cancelled_at: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        """A record as any version wrote it (``ValueError`` when it is not one)."""
        if not isinstance(data, Mapping) or not data.get("job_id"):
            raise ValueError("not a ledger record (no job_id)")
        known = {f.name for f in fields(cls)} - {"sets", "extra"}
        text = {k: str(data[k]) for k in ("kind", "job_id", "name", "run_dir", "log", "launcher", "key", "profile",
                                          "nodes", "spec_file", "sweep_dir", "user", "cwd") if data.get(k) is not None}
        opt = {k: str(data[k]) if data.get(k) is not None else None
               for k in ("module", "cluster", "nodes_arg", "resubmit_of", "git")}
        launcher = text.get("launcher", "sbatch")
        return cls(**{"kind": "job", "name": "job", **text}, **opt,  # type: ignore[arg-type]
                   task_logs=bool(data.get("task_logs", launcher == "submitit")),
                   args=tuple(map(str, data.get("args") or ())), sets=tuple(map(str, data.get("set") or ())),
                   command=None if data.get("command") is None else tuple(map(str, data["command"])),
                   by_hand=bool(data.get("by_hand")), arrays=tuple(map(str, data.get("arrays") or ())),
                   trial=None if data.get("trial") is None else int(data["trial"]),
                   worker=None if data.get("worker") is None else int(data["worker"]),
                   params=dict(data.get("params") or {}), submitted_at=_number(data.get("submitted_at")) or 0.0,
                   cancelled_at=_number(data.get("cancelled_at")),
                   extra={k: v for k, v in data.items() if k not in known and k != "set"},
                   schema=int(data.get("schema") or 0))

    def to_json(self) -> dict[str, Any]:
        """The record as written (in this version's layout)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("sets", "extra")}
        out["set"], out["schema"] = list(self.sets), SCHEMA
        for k in ("args", "arrays"):
            out[k] = list(out[k])
        out["command"] = None if self.command is None else list(self.command)
        return {**self.extra, **out}

    def ids(self) -> list[str]:
        """Its Slurm job ids: a sweep's worker arrays, else its own."""
        return list(self.arrays) or [self.job_id]


def _number(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None



def project_root(start: Path | None = None) -> Path:
    """The project folder holding ``start`` (default: the working folder): the nearest one above with a
    ``pyproject.toml`` or ``.git``; else ``start`` itself."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").exists() or (folder / ".git").exists():
            return folder
    return here


def folder() -> Path:
    """Where the records live."""
    return Path(os.environ[LEDGER_ENV]) if os.environ.get(LEDGER_ENV) else project_root() / "runs" / "ledger"


def _name(job_id: str) -> str:
    # Job ids are digits (an array task 12_3); anything else is kept out of the file name.
    return re.sub(r"[^0-9A-Za-z_.-]", "_", job_id) + ".json"


def write(record: Record, replace_existing: bool = True) -> Path:
    """Write ``record`` as ``<ledger>/<key or job_id>.json``; with ``replace_existing=False`` an existing record stays
    as it is. A new record (no ``submitted_at``) gets the time, user, working folder and git commit."""
    path = folder() / _name(record.key or record.job_id)
    if path.exists() and not replace_existing:
        return path
    full = record if record.submitted_at else replace(  # a new record: when, who, where, which code
        record, submitted_at=round(time.time(), 3), user=record.user or os.environ.get("USER") or current_user(),
        cwd=record.cwd or str(Path.cwd()), git=record.git or git_commit(Path.cwd()))
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name no other process on any host picks (the login node and the job share the file system).
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(full.to_json(), indent=1) + "\n")
    if replace_existing:
        os.replace(tmp, path)  # readers see the old record or the new one, never half of one
        return path
    try:  # a link never replaces: the submitting side's record, written meanwhile, wins
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:  # no hard links here: an exclusive create (a reader may meet it half-written and skip it)
        with contextlib.suppress(FileExistsError), open(path, "x") as f:
            f.write(tmp.read_text())
    finally:
        tmp.unlink(missing_ok=True)
    return path


def records() -> list[Record]:
    """Every record, newest first (unreadable files are skipped: a record is being replaced, or was not ours)."""
    out = []
    for path in folder().glob("*.json"):
        try:
            out.append(Record.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda r: r.submitted_at, reverse=True)


def current_user() -> str:
    """Who runs this (for records, and to tell a user's own jobs from others')."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())


def register(run_dir: str, args: list[str]) -> int:
    """From a batch script (a hand-run template, or ``LAUNCHER=sbatch``): record this job unless it is recorded."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or (folder() / _name(job)).exists():  # the submitting side recorded it (more fully)
        return 0
    record = Record(kind="job", name=os.environ.get("SLURM_JOB_NAME", "job"), job_id=job, launcher="sbatch",
                    run_dir=run_dir, args=tuple(args), log=nodes.job_fields(job).get("StdOut") or "",
                    nodes=os.environ.get("SLURM_JOB_NUM_NODES") or "", by_hand=True)
    try:
        write(record, replace_existing=False)
    except OSError as err:  # the job runs on without its record
        print(f"ledger: could not record job {job}: {err}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.job.ledger register RUN_DIR [ARGS…]`` (what a batch script runs)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "register":
        print("usage: python -m cluster.job.ledger register RUN_DIR [ARGS...]", file=sys.stderr)
        return 2
    return register(args[1], args[2:])


if __name__ == "__main__":
    sys.exit(main())
