"""What a job runs: the built-in trainer with key=value overrides, or the user's own command.

``python -m cluster submit -- optim.lr=0.1``           the built-in trainer (every word is key=value)
``python -m cluster submit -- python train.py --lr 1``  a command (its first word is not key=value)
``python -m cluster submit --module pkg.train -- ARGS`` ``python -m pkg.train ARGS``
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from cluster.profile import Profile
from trainer.core.errors import UserError

OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*=")
"""A trainer override: a dotted key, '=', a value."""


@dataclass(frozen=True)
class Command:
    """A user's command, run in every task by ``python -m trainer.launch`` (argv[0] ``python``: the job's interpreter)."""

    argv: tuple[str, ...]

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


def parse(args: list[str], module: str | None = None, check_import: bool = True) -> Command | None:
    """The command in ``args`` (None: the built-in trainer, ``args`` are its overrides); ``check_import``: the jobs
    run this interpreter, so a module it cannot import is refused here."""
    if module is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module):
            raise UserError("--module", f"{module!r} is not a dotted module name", "e.g. --module mypkg.train")
        if check_import:
            _check_importable(module)
        return Command(("python", "-m", module, *args))
    if not args or OVERRIDE.match(args[0]):
        return None
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
