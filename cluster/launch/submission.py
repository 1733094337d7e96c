"""What is submitted, parsed once: the profile, the built-in trainer's overrides or a command, the run folder, and
how it was asked for (kept in the ledger, so that ``resubmit`` asks again the same way)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from cluster.job.ledger import Record
from cluster.launch.command import Command, parse
from cluster.profile import Profile


def python_for(p: Profile) -> str:
    """The interpreter the compute nodes run: the profile's, or the one submitting (same venv)."""
    return sys.executable if p.python == "python" else p.python


def split_run_dir(args: list[str]) -> tuple[list[str], str | None]:
    """Take ``run.dir=…`` out of the overrides: the batch script owns it (as RUN_DIR) to find requeue markers."""
    rest = [a for a in args if not a.startswith("run.dir=")]
    dirs = [a.split("=", 1)[1] for a in args if a.startswith("run.dir=")]
    return rest, (dirs[-1] if dirs else None)


@dataclass(frozen=True)
class Origin:
    """How a submission was asked for: ``--cluster``, ``--set``, ``--nodes``, and the job it resubmits."""

    cluster: str | None = None
    sets: tuple[str, ...] = ()
    nodes_arg: str | None = None
    resubmit_of: str | None = None


@dataclass(frozen=True)
class Submission:
    """One job to submit: the built-in trainer with key=value ``args``, or the command in ``args``."""

    profile: Profile
    args: tuple[str, ...]
    """As given: the built-in trainer's overrides (``run.dir=`` included), or the command's words."""
    command: Command | None
    """The command (``python -m module args`` with ``module``); None: the built-in trainer."""
    module: str | None = None
    origin: Origin = field(default_factory=Origin)

    @classmethod
    def parse(cls, p: Profile, args: list[str], module: str | None = None, origin: Origin | None = None) -> Submission:
        """Decide once whether ``args`` are overrides or a command (a command's program is checked where it can
        be: not inside a container or another interpreter, which have packages of their own)."""
        command = parse(args, module, check_import=p.container.runtime == "none" and python_for(p) == sys.executable)
        return cls(p, tuple(args), command, module, origin or Origin())

    @property
    def overrides(self) -> list[str]:
        """The built-in trainer's overrides without ``run.dir`` (the batch script owns it); none for a command."""
        return [] if self.command else split_run_dir(list(self.args))[0]

    @property
    def run_dir(self) -> str | None:
        """The built-in trainer's ``run.dir=`` when given (a command's folder is ``$RUN_DIR`` or the job's)."""
        return None if self.command else split_run_dir(list(self.args))[1]

    def record(self, launcher: str, task_logs: bool, job_id: str, run_dir: str, log: str) -> Record:
        """The ledger's record of it, once Slurm gave it ``job_id``."""
        p, o = self.profile, self.origin
        return Record(kind="job", name=p.job_name, job_id=job_id, run_dir=run_dir, log=log, task_logs=task_logs,
                      launcher=launcher, profile=p.name, nodes=p.node_range, args=self.args, module=self.module,
                      command=None if self.command is None else tuple(self.command.argv), cluster=o.cluster,
                      sets=o.sets, nodes_arg=o.nodes_arg, resubmit_of=o.resubmit_of)
