"""``python -m cluster``: every command line of the cluster tools in one place, each sub-command with its handler.

submit, render, sweep, sweep-status, sweep-dashboard, suspects, save-now, and the run tools runs, status, logs,
cancel, resubmit: what `make submit`, `make sweep`, `make runs` and the template regeneration call.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.core.errors import UserError, exit_code_of

Handler = Callable[[argparse.Namespace], int]


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the sub-command's handler; exit 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_submit, _render, _sweep, _sweep_views, _nodes_and_runs, _run_tools):
        add(sub)
    ns = parser.parse_args(argv)
    return exit_code_of(lambda: ns.handler(ns))


def _command(sub: Any, name: str, handler: Handler, help: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help)
    p.set_defaults(handler=handler)
    return p


def _profile_sets(values: list[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` words as profile overrides."""
    bad = [kv for kv in values if "=" not in kv or kv.startswith("=")]
    if bad:
        raise UserError("--set", f"{bad[0]!r} is not KEY=VALUE", "e.g. --set nodes=1")
    return {key: value for key, _, value in (kv.partition("=") for kv in values)}


def _submit(sub: Any) -> None:
    s = _command(sub, "submit", submit_cmd, "submit training (or any command: -- CMD ARGS…) to Slurm")
    s.add_argument("--cluster", default="dev", help="profile name in cluster/profiles, or a YAML path")
    s.add_argument("--nodes", help="override the profile's node count: N, or MIN-MAX for a job that may start smaller")
    s.add_argument("--launcher", default="submitit", help="submitit (default) or sbatch")
    s.add_argument("--dry-run", action="store_true", help="print the exact script; submit nothing")
    s.add_argument("--wait", action="store_true", help="wait for the job and print its result")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a profile key")
    s.add_argument("--module", help="run `python -m MODULE ARGS…` (the words after --) in every task")
    s.add_argument("args", nargs="*", help="training overrides key=value, or after -- a command: python train.py …")


def submit_cmd(ns: argparse.Namespace) -> int:
    from cluster.launch.launchers import pick
    from cluster.launch.submission import Origin, Submission
    from cluster.launch.submit import submit
    from cluster.profile import load_profile, node_range

    launcher = pick(ns.launcher)
    overrides = _profile_sets(ns.set)
    if ns.nodes is not None:
        overrides.update(node_range(ns.nodes))
    origin = Origin(cluster=ns.cluster, sets=tuple(ns.set), nodes_arg=ns.nodes)  # for `resubmit`
    s = Submission.parse(load_profile(ns.cluster, overrides), ns.args, ns.module, origin)
    return submit(s, launcher, ns.dry_run, ns.wait)


def _render(sub: Any) -> None:
    r = _command(sub, "render", render_cmd, "print the sbatch template for a profile (hand-run scripts in slurm/)")
    r.add_argument("--cluster", default="example-h100")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--command", dest="command_template", action="store_true",
                   help="the template for any command (slurm/run.sbatch)")


def render_cmd(ns: argparse.Namespace) -> int:
    from cluster.launch.command import Command, Trainer
    from cluster.launch.render import render_sbatch
    from cluster.profile import load_profile

    p = load_profile(ns.cluster, _profile_sets(ns.set))
    sets = "".join(f" --set {kv}" for kv in ns.set) + (" --command" if ns.command_template else "")
    usage = "COMMAND [ARG ...]` (e.g. python train.py --lr 0.1)" if ns.command_template else "[key=value ...]`"
    origin = (f"Hand-run template: activate the venv, then `sbatch THIS_FILE {usage} (sbatch options such as "
              f"--nodes=1 override the lines below).\n# Made by `python -m cluster render --cluster {ns.cluster}{sets}`: "
              "edit the profile and regenerate rather than editing by hand.")
    print(render_sbatch(p, "python", Command(()) if ns.command_template else Trainer(()), origin), end="")
    return 0


def _sweep(sub: Any) -> None:
    w = _command(sub, "sweep", sweep_cmd, "submit a hyper-parameter sweep: an Optuna study, its workers one Slurm job array")
    w.add_argument("spec", help="sweep YAML, e.g. cluster/sweeps/example.yaml")
    w.add_argument("--dry-run", action="store_true", help="print the trials and the workers' script; submit nothing")
    w.add_argument("--wait", action="store_true", help="wait for every trial, print the table; exit 1 if one failed")
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile key (after the spec's profile:)")
    w.add_argument("--resume", metavar="SWEEP_DIR", help="add the spec's trials to this sweep's study (new workers)")


def sweep_cmd(ns: argparse.Namespace) -> int:
    from cluster.sweeps.submit import run

    return run(ns.spec, _profile_sets(ns.set), ns.dry_run, ns.wait, ns.resume)


def _sweep_views(sub: Any) -> None:
    st = _command(sub, "sweep-status", lambda ns: _show_sweep(ns.sweep_dir), "print a sweep's trials ranked by its metric")
    st.add_argument("sweep_dir", nargs="?", help="a folder under sweeps/ (default: the newest)")
    sd = _command(sub, "sweep-dashboard", lambda ns: _dashboard(ns.sweep_dir, ns.port),
                  "optuna-dashboard on a sweep's study, on this machine only")
    sd.add_argument("sweep_dir", nargs="?", help="a folder under sweeps/ (default: the newest)")
    sd.add_argument("--port", type=int, default=8080)


def _show_sweep(sweep_dir: str | None) -> int:
    from cluster.sweeps.status import show_status

    return show_status(sweep_dir)


def _dashboard(sweep_dir: str | None, port: int) -> int:
    from cluster.sweeps.dashboard import serve

    return serve(sweep_dir, port)


def _nodes_and_runs(sub: Any) -> None:
    sp = _command(sub, "suspects", suspects_cmd,
                  "the evidence jobs left against nodes and which nodes new jobs avoid; or clear one")
    sp.add_argument("--clear", metavar="NODE", help="forget NODE's evidence (all: every node's)")
    sp.add_argument("--cluster", default="dev", help="the profile whose suspect_after applies (default: dev)")
    sn = _command(sub, "save-now", lambda ns: save_now(Path(ns.run_dir)),
                  "ask a running job to save a checkpoint at its next poll, and go on")
    sn.add_argument("run_dir", help="the run folder (runs/<job id>)")


def suspects_cmd(ns: argparse.Namespace) -> int:
    from cluster.job import suspects
    from cluster.profile import load_profile

    return suspects.show(Path(suspects.default_path()), ns.clear, load_profile(ns.cluster).suspect_after)


def save_now(run_dir: Path) -> int:
    """Leave ``save-now`` in a run folder: rank 0 sees it within ``checkpoint.poll_steps`` steps, all ranks save."""
    if not (run_dir / "config.yaml").is_file():
        raise UserError("RUN_DIR", f"{run_dir} is not a run folder (no config.yaml)", "pass runs/<job id> of a running job")
    (run_dir / "save-now").touch()
    print(f"asked {run_dir} to save at its next poll (checkpoint.poll_steps)")
    return 0


def _run_tools(sub: Any) -> None:
    r = _command(sub, "runs", runs_cmd, "recent runs (jobs, sweeps): state, attempts, nodes, progress, metric, age")
    r.add_argument("pattern", nargs="?", help="a name or job id pattern, e.g. 'char-*'")
    r.add_argument("--state", help="pending, running, requeued, finished, failed, cancelled, …")
    r.add_argument("--since", help="submitted within: 30m, 6h, 2d, or since a date (2026-11-25)")
    r.add_argument("--trials", action="store_true", help="list sweeps' trials too")
    r.add_argument("--json", action="store_true", help="JSON for scripts")
    r.add_argument("--width", type=int, default=0, help="table width (default: the terminal's)")
    r.add_argument("-n", type=int, default=0, metavar="N", help="the newest N runs (default: a screenful)")
    r.add_argument("--all", action="store_true", help="every matching run")
    s = _command(sub, "status", status_cmd, "one run: attempts and causes, progress, ETA, checkpoint, W&B run, logs")
    s.add_argument("run", help="a run folder, job id or name")
    lg = _command(sub, "logs", logs_cmd, "a run's output, one attempt or rank at a time")
    lg.add_argument("run", help="a run folder, job id or name")
    lg.add_argument("--rank", type=int, help="only this rank's lines (the Slurm task; a node with launch: torchrun)")
    lg.add_argument("--attempt", help="only this attempt: Slurm's restart count (0: the first; 0.1: a restart "
                    "on spare nodes inside the allocation)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing while the job runs")
    c = _command(sub, "cancel", cancel_cmd, "cancel a run's job (a sweep: its workers); its folder stays")
    c.add_argument("run", help="a run folder, job id or name")
    rs = _command(sub, "resubmit", resubmit_cmd, "submit a run again: same command, profile and folder; it resumes")
    rs.add_argument("run", help="a run folder, job id or name")
    rs.add_argument("overrides", nargs="*", help="built-in trainer overrides key=value (not model.*)")
    rs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a profile key")


def runs_cmd(ns: argparse.Namespace) -> int:
    from cluster.runs.table import show

    size = shutil.get_terminal_size((120, 24))
    # A screenful: the heading and the line about older runs fit with the prompt. JSON (for scripts): every run.
    limit = None if ns.all or (ns.json and not ns.n) else ns.n or max(10, size.lines - 4)
    return show(ns.state, ns.since, ns.pattern, ns.json, ns.trials, ns.width or size.columns, limit)


def status_cmd(ns: argparse.Namespace) -> int:
    from cluster.runs.status import show

    return show(ns.run)


def logs_cmd(ns: argparse.Namespace) -> int:
    from cluster.job.nodes import job_state_now
    from cluster.runs.logs import show
    from cluster.runs.status import resolve
    from cluster.runs.table import LIVE

    record = resolve(ns.run)

    def alive() -> bool:  # Slurm not answering is no proof of an end: keep following
        state = job_state_now(record.job_id)
        return state is None or LIVE.get(state) is not None

    return show(record, ns.rank, ns.attempt, ns.follow, alive)


def cancel_cmd(ns: argparse.Namespace) -> int:
    from cluster.runs.actions import cancel

    return cancel(ns.run)


def resubmit_cmd(ns: argparse.Namespace) -> int:
    from cluster.runs.actions import resubmit

    return resubmit(ns.run, ns.overrides, ns.set)


if __name__ == "__main__":
    sys.exit(main())
