"""Submit one job: the checks that need Slurm or the trainer (a partition too small, bad overrides, snapshots the
nodes cannot hold, suspect nodes), then its launcher (cluster/launch/launchers.py), then its ledger record."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.job import ledger, nodes, suspects
from cluster.launch.launchers import Launcher
from cluster.launch.submission import Submission
from cluster.profile import Profile
from trainer.core.errors import UserError

if TYPE_CHECKING:
    from trainer.core.schema import Config


def suspect_nodes(p: Profile, say: Callable[[str], None] = print) -> list[str]:
    """The nodes other jobs' evidence avoids (cluster/job/suspects.py), which a new job excludes, as long as the
    partition keeps enough nodes for it; the least suspect are used again otherwise (fail open), said in one line."""
    ordered = suspects.active(Path(suspects.default_path()), p.suspect_after)
    if not ordered:
        return []
    need = (p.min_nodes if p.ranged else p.nodes) + p.spare_nodes
    avoid, again = suspects.fail_open(ordered, nodes.usable(p.partition) or set(), need)
    if avoid:
        say(f"excluding suspect node(s) {', '.join(avoid)} (`python -m cluster suspects` shows the evidence, "
            "--clear NODE forgets it)")
    if again:
        say(f"using suspect node(s) {', '.join(again)} again: excluding them too would leave fewer than {need} "
            f"usable node(s) for this job")
    return avoid


def check_fits(p: Profile) -> None:
    """Refuse a job its partition can never hold: its training nodes and its spares at once (asked sinfo; when
    sinfo cannot say, Slurm decides)."""
    seen = nodes.states(p.partition)
    total = p.nodes + p.spare_nodes
    if seen is None or total <= len(seen):
        return
    where = f"partition {p.partition}" if p.partition else "the cluster"
    if p.ranged and p.spare_nodes:
        raise UserError("profile.spare_nodes", f"NODES={p.node_range} with spare_nodes={p.spare_nodes} needs {total} "
                        f"nodes at once ({p.nodes} to train on, {p.spare_nodes} spare) but {where} has {len(seen)}",
                        f"NODES={p.node_range} without spare nodes (a lost node then shrinks the job)"
                        + (f", or NODES={p.min_nodes}-{len(seen) - p.spare_nodes} with the spare"
                           if len(seen) - p.spare_nodes > p.min_nodes else ""))
    field = "profile.spare_nodes" if p.spare_nodes else "NODES"
    raise UserError(field, f"{total} node(s) asked for ({p.nodes} + {p.spare_nodes} spare) but {where} has "
                    f"{len(seen)}", f"ask for at most {len(seen)} in all, e.g. NODES={min(p.nodes, len(seen))}")


def check_slurm() -> None:
    """Fail clearly when there is no Slurm to talk to."""
    if shutil.which("sbatch") is None:
        raise UserError("LAUNCHER", "sbatch is not on PATH", "submit from a Slurm login node, or start `make dev-cluster` "
                        "and run `eval \"$(slurm/dev-cluster.sh env)\"`")


def check_binds(p: Profile) -> None:
    """A container binds the submit folder and RUN_DIR by name, in lists that ',' and ':' separate (apptainer --bind,
    pyxis --container-mounts, docker -v): a path holding either would split into other paths."""
    if p.container.runtime == "none":
        return
    for field, path in (("the submit folder", str(Path.cwd())), ("RUN_DIR", os.environ.get("RUN_DIR", ""))):
        if "," in path or ":" in path:
            raise UserError(field, f"{path!r} holds ',' or ':', which split {p.container.runtime}'s list of binds",
                            "submit from, and keep the run folder in, a path without them")


def decide(p: Profile) -> None:
    """What a submission of ``p`` asks Slurm for, decided where Slurm can be asked, before its script is rendered (a
    dry run prints exactly what would be submitted): the partition can hold it, and whether it asks for an expedited
    requeue. Every submission goes through here, a job's and a sweep's workers'."""
    check_binds(p)
    check_fits(p)
    if p.requeue_expedite == "auto":  # the script says what was decided
        p.requeue_expedite = "yes" if nodes.offers_expedited_requeue() else "no"


def submit(s: Submission, launcher: Launcher, dry_run: bool, wait: bool) -> int:
    """Submit (or with ``dry_run`` print the script of) one job; with ``wait``, block and report its result."""
    p = s.profile
    s.work.check(p, launcher.warned_with(p))
    launcher.check(s)
    decide(p)
    if dry_run:  # the script on stdout; what a real submit would add on the command line, on stderr
        print(launcher.script(s), end="")
        suspect_nodes(p, lambda line: print(f"dry run: a real submit would be {line}", file=sys.stderr))
        return 0
    check_slurm()
    Path(p.log_dir).mkdir(parents=True, exist_ok=True)

    def record(job_id: str, log: str) -> None:  # before waiting for the job: where its run folder and logs are
        try:
            ledger.write(s.record(launcher.name, launcher.task_logs, job_id, str(Path(log).resolve())))
        except OSError as err:  # the job is submitted; only `runs` will not know it
            print(f"warning: could not record job {job_id} in {ledger.folder()}: {err}", file=sys.stderr)

    return launcher.submit(s, wait, suspect_nodes(p), record)


def load_train_config(args: list[str]) -> Config:
    """The built-in trainer's checks of ``args`` (imported here: they load torch, which listing or rendering never
    needs)."""
    from trainer.builtin.build import load_checked

    return load_checked(args)
