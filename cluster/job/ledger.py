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
from pathlib import Path
from typing import Any

from cluster.job import nodes
from trainer.core.events import git_commit

LEDGER_ENV = "TRAINER_LEDGER"
"""A folder to keep the ledger in instead of ``<project>/runs/ledger`` (tests, or a shared folder of your choice)."""


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


def write(record: dict[str, Any], replace: bool = True) -> Path:
    """Write ``record`` (it has ``job_id``) as ``<ledger>/<key or job_id>.json`` (a sweep's trials share their
    worker's job id, so they have a key); with ``replace=False`` an existing record stays as it is. The time, user,
    working folder and git commit are added when missing."""
    path = folder() / _name(str(record.get("key") or record["job_id"]))
    if path.exists() and not replace:
        return path
    full = {"submitted_at": round(time.time(), 3), "user": os.environ.get("USER") or current_user(), "cwd": str(Path.cwd()),
            "git": git_commit(Path.cwd()), **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name no other process on any host picks (the login node and the job share the file system).
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(full, indent=1) + "\n")
    if replace:
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


def when(record: dict[str, Any], default: float = 0.0) -> float:
    """A record's submission time (``default`` when it has none that reads as a number)."""
    try:
        return float(record.get("submitted_at") or default)
    except (TypeError, ValueError):
        return default


def records() -> list[dict[str, Any]]:
    """Every record, newest first (unreadable files are skipped: a record is being replaced, or was not ours)."""
    out = []
    for path in folder().glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "job_id" in data:
            out.append(data)
    return sorted(out, key=when, reverse=True)


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
    record = {"kind": "job", "name": os.environ.get("SLURM_JOB_NAME", "job"), "job_id": job, "launcher": "sbatch",
              "run_dir": run_dir, "args": args, "log": nodes.job_fields(job).get("StdOut"),
              "nodes": os.environ.get("SLURM_JOB_NUM_NODES"), "by_hand": True}
    try:
        write(record, replace=False)
    except OSError as err:  # the job runs on without its record
        print(f"ledger: could not record job {job}: {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m cluster.job.ledger register RUN_DIR [ARGS…]
    if len(sys.argv) < 3 or sys.argv[1] != "register":
        print("usage: python -m cluster.job.ledger register RUN_DIR [ARGS...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(register(sys.argv[2], sys.argv[3:]))
