"""What is submitted, parsed once: the profile, the built-in trainer's overrides or a command, the run folder, and
how it was asked for (kept in the ledger, so that ``resubmit`` asks again the same way)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cluster.job.ledger import Record
from cluster.launch.command import Work, parse
from cluster.profile import Profile
from trainer.core.env import default_run_dir


def python_for(p: Profile) -> str:
    """The interpreter the compute nodes run: the profile's, or the one submitting (same venv)."""
    return sys.executable if p.python == "python" else p.python


@dataclass(frozen=True)
class Origin:
    """How a submission was asked for: ``--cluster``, ``--set``, ``--nodes``, and the job it resubmits."""

    cluster: str | None = None
    sets: tuple[str, ...] = ()
    nodes_arg: str | None = None
    resubmit_of: str | None = None


@dataclass(frozen=True)
class Submission:
    """One job to submit: the profile, what it runs (``work``: the built-in trainer or a command) and how it was asked
    for."""

    profile: Profile
    args: tuple[str, ...]
    """As given: the built-in trainer's overrides (``run.dir=`` included), or the command's words."""
    work: Work
    module: str | None = None
    origin: Origin = field(default_factory=Origin)

    @classmethod
    def parse(cls, p: Profile, args: list[str], module: str | None = None, origin: Origin | None = None) -> Submission:
        """Decide once whether ``args`` are overrides or a command (a command's program is checked where it can
        be: not inside a container or another interpreter, which have packages of their own)."""
        work = parse(args, module, check_import=p.container.runtime == "none" and python_for(p) == sys.executable)
        return cls(p, tuple(args), work, module, origin or Origin())

    def run_folder(self, job_id: str) -> str:
        """Where the job's run folder is, as its batch script decides it: ``$RUN_DIR``, ``run.dir=``, or the job's."""
        return os.environ.get("RUN_DIR") or self.work.run_dir or default_run_dir(job_id)

    def record(self, launcher: str, task_logs: bool, job_id: str, log: str) -> Record:
        """The ledger's record of it, once Slurm gave it ``job_id``."""
        p, o = self.profile, self.origin
        return Record(kind="job", name=p.job_name, job_id=job_id, run_dir=str(Path(self.run_folder(job_id)).resolve()),
                      log=log, task_logs=task_logs, launcher=launcher, profile=p.name, nodes=p.node_range, args=self.args,
                      module=self.module, **self.work.ledger(), cluster=o.cluster, sets=o.sets, nodes_arg=o.nodes_arg,
                      resubmit_of=o.resubmit_of)
