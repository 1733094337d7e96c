"""What a job runs, in two kinds decided once (``parse``): the built-in trainer with key=value overrides, or the
user's own command. Each kind renders its own part of the batch script and makes its own submitit task, so no other
code asks which kind it holds.

``python -m cluster submit -- optim.lr=0.1``           the built-in trainer (every word is key=value)
``python -m cluster submit -- python train.py --lr 1``  a command (its first word is not key=value)
``python -m cluster submit --module pkg.train -- ARGS`` ``python -m pkg.train ARGS``
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.launch.render import command_line, doctor_step, host_python, launch_line
from cluster.profile import Profile
from trainer.core.errors import UserError

if TYPE_CHECKING:
    from cluster.launch.task import CommandTask, TrainTask

OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*=")
"""A trainer override: a dotted key, '=', a value."""


@dataclass(frozen=True)
class Trainer:
    """The built-in trainer, ``python -m trainer`` with ``key=value`` overrides in every task."""

    args: tuple[str, ...]
    """As given, ``run.dir=`` included."""
    reports_itself = True
    """The session writes the run's report; the batch shell need not."""

    @property
    def overrides(self) -> list[str]:
        """The overrides without ``run.dir`` (the batch script owns the folder, as ``$RUN_DIR``)."""
        return split_run_dir(list(self.args))[0]

    @property
    def run_dir(self) -> str | None:
        """``run.dir=`` when given."""
        return split_run_dir(list(self.args))[1]

    @property
    def doctor_args(self) -> list[str]:
        """What the preflight doctor checks the run with."""
        return self.overrides

    def describe(self) -> str:
        return ""

    def check(self, p: Profile, warned_with: str) -> None:
        """The overrides as the trainer will take them (``run.dir`` aside), refused here with the key and a HINT."""
        from cluster.launch.checks import trainer_args

        trainer_args(self.overrides, warned_with, p)

    def results(self, job_id: str, results: list[Any]) -> list[str]:
        """submitit's results of every task, as lines: the scores, the world size and each rank's checksum."""
        main = results[0]
        scores = ", ".join(f"{k[5:]} {v:.4g}" for k, v in main.items() if k.startswith("test_")) or "no evaluation set"
        lines = [f"job {job_id} done: {scores}, world size {main['world_size']}, checkpoint {main['checkpoint']}"]
        for r in results:
            checksum = f", parameter checksum {r['param_checksums'][r['rank']]}" if "param_checksums" in r else ""
            lines.append(f"  rank {r['rank']}: world size {r['world_size']}{checksum}")
        return lines

    def prelude(self) -> list[str]:
        """An sbatch script's lines before the first attempt: ``run.dir`` given to sbatch is refused."""
        return [
            'for arg in "$@"; do',
            '  if [[ $arg == run.dir=* ]]; then echo "error: run.dir: set RUN_DIR=… instead (watched here)" >&2; exit 2; fi',
            "done",
        ]

    def attempt(self, p: Profile, python: str) -> list[str]:
        """An attempt's lines in an sbatch script: the doctor, the trainers."""
        return [
            *doctor_step(p, launch_line(p, python, self.overrides, module="trainer.doctor"), host_python(p, python)),
            "rc=0", *_or_rc(self.launch(p, python)),
        ]

    def launch(self, p: Profile, python: str) -> list[str]:
        """The lines that start the trainers in every task (``"$@"``: more overrides given to sbatch)."""
        return launch_line(p, python, self.overrides)

    def task(self, p: Profile) -> TrainTask:
        from cluster.launch.task import TrainTask

        return TrainTask(list(self.args))

    def task_line(self, p: Profile) -> str:
        """What each submitit task runs, as a command line (for dry runs)."""
        return f"python -m trainer {shlex.join(self.args)}"

    def ledger(self) -> dict[str, Any]:
        return {"command": None}


@dataclass(frozen=True)
class Command:
    """A user's command, run in every task by ``python -m trainer.launch`` (argv[0] ``python``: the job's interpreter)."""

    argv: tuple[str, ...]
    reports_itself = False
    """A command without the session API writes no report: the batch shell writes what it saw."""
    run_dir: str | None = None
    """A command's folder is ``$RUN_DIR``, or the job's."""

    doctor_args: tuple[str, ...] = ()
    """The preflight doctor checks a command's job with the defaults."""

    def describe(self) -> str:
        return f"command: {self}, "

    def check(self, p: Profile, warned_with: str) -> None:
        """A command checks its own arguments when it starts."""

    def results(self, job_id: str, results: list[Any]) -> list[str]:
        return [f"job {job_id} done: the command exited 0 on {len(results)} task(s)"]

    def prelude(self) -> list[str]:
        return []

    def attempt(self, p: Profile, python: str) -> list[str]:
        """An attempt's lines in an sbatch script: the doctor, then the command in every task."""
        doctor = launch_line(p, python, [], module="trainer.doctor", user_args=False)
        return [*doctor_step(p, doctor, host_python(p, python)), "rc=0", *_or_rc(self.launch(p, python))]

    def launch(self, p: Profile, python: str) -> list[str]:
        """The line that starts the command in every task (``"$@"``: arguments given to sbatch, appended)."""
        return command_line(p, python, [*self.launch_args(p), *self.argv])

    def task(self, p: Profile) -> CommandTask:
        from cluster.launch.task import CommandTask

        return CommandTask(list(self.argv), p.signal, requeue_after(p) if p.requeue_on_signal else None)

    def task_line(self, p: Profile) -> str:
        """What each submitit task runs, as a command line (for dry runs)."""
        return f"python -m trainer.launch {shlex.join([*self.launch_args(p), *self.argv])}"

    def ledger(self) -> dict[str, Any]:
        return {"command": tuple(self.argv)}

    def launch_args(self, p: Profile) -> list[str]:
        """``python -m trainer.launch``'s options for this profile, then ``--`` (the command follows)."""
        args = ["--signal", p.signal]
        if p.requeue_on_signal:
            args += ["--requeue-after", str(requeue_after(p))]
        if p.launch == "torchrun":
            args += ["--torchrun", str(p.ntasks_per_node)]
        return [*args, "--"]

    def __str__(self) -> str:
        return shlex.join(self.argv)


def requeue_after(p: Profile) -> int:
    """Seconds a command may go on after the warning before it is stopped and requeued: the grace, less time to
    stop it (trainer.launch waits 10 s after TERM) and to requeue."""
    return max(1, p.signal_grace_s - 20)


Work = Trainer | Command
"""What a job runs."""


def _or_rc(launch: list[str]) -> list[str]:
    """Launch lines whose last one records its exit code in ``$rc`` instead of ending the script."""
    return [*launch[:-1], launch[-1] + " || rc=$?"]


def split_run_dir(args: list[str]) -> tuple[list[str], str | None]:
    """Take ``run.dir=…`` out of the overrides: the batch script owns it (as RUN_DIR) to find requeue markers."""
    rest = [a for a in args if not a.startswith("run.dir=")]
    dirs = [a.split("=", 1)[1] for a in args if a.startswith("run.dir=")]
    return rest, (dirs[-1] if dirs else None)


def parse(args: list[str], module: str | None = None, check_import: bool = True) -> Work:
    """What ``args`` ask for: a command, or the built-in trainer with ``args`` as its overrides; ``check_import``: the
    jobs run this interpreter, so a module it cannot import is refused here."""
    if module is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module):
            raise UserError("--module", f"{module!r} is not a dotted module name", "e.g. --module mypkg.train")
        if check_import:
            _check_importable(module)
        return Command(("python", "-m", module, *args))
    if not args or OVERRIDE.match(args[0]):
        return Trainer(tuple(args))
    if args[0] in ("python", "python3") and len(args) > 1 and not args[1].startswith("-") and not Path(args[1]).is_file():
        # Jobs start in the folder they are submitted from: a script missing here fails on the cluster too.
        raise UserError("CMD", f"{args[1]!r} is not a file (looked in {Path.cwd()})",
                        "give the script's path from the folder you submit from; the job starts there")
    return Command(tuple(args))


def _check_importable(module: str) -> None:
    """A module the job could not import fails here, as a missing script does: jobs start in this folder, with this
    interpreter's packages."""
    import importlib.util
    import sys

    here = str(Path.cwd())
    added = here not in sys.path
    if added:  # `python -m` puts the working folder first, as the job's tasks will
        sys.path.insert(0, here)
    try:
        found = importlib.util.find_spec(module)
    except Exception as err:  # a parent package that is missing or fails to import (any error its __init__ raises)
        found, why = None, f"{type(err).__name__}: {err}"
    else:
        why = "no such module"
    finally:
        if added:
            sys.path.remove(here)
    if found is None:
        raise UserError("--module", f"{module!r} cannot be imported here ({why}; looked in {here} and {sys.prefix})",
                        "submit from the folder that holds the package, or pip install it into this environment")
