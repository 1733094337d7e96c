"""The run tools' command lines: ``python -m cluster runs|status|logs|cancel|resubmit`` (see cluster/__main__.py)."""

from __future__ import annotations

import argparse
import shutil
from typing import Any


def add_parsers(sub: Any) -> None:
    """The run tools' sub-commands on ``python -m cluster``'s parser."""
    r = sub.add_parser("runs", help="recent runs (jobs, sweeps): state, attempts, nodes, progress, metric, age")
    r.add_argument("pattern", nargs="?", help="a name or job id pattern, e.g. 'char-*'")
    r.add_argument("--state", help="pending, running, requeued, finished, failed, cancelled, …")
    r.add_argument("--since", help="submitted within: 30m, 6h, 2d, or since a date (2026-11-25)")
    r.add_argument("--trials", action="store_true", help="list sweeps' trials too")
    r.add_argument("--json", action="store_true", help="JSON for scripts")
    r.add_argument("--width", type=int, default=0, help="table width (default: the terminal's)")
    s = sub.add_parser("status", help="one run: attempts and causes, progress, ETA, checkpoint, W&B run, logs")
    s.add_argument("run", help="a run folder, job id or name")
    lg = sub.add_parser("logs", help="a run's output, one attempt or rank at a time")
    lg.add_argument("run", help="a run folder, job id or name")
    lg.add_argument("--rank", type=int, help="only this rank's lines (the Slurm task; a node with launch: torchrun)")
    lg.add_argument("--attempt", help="only this attempt: Slurm's restart count (0: the first; 0.1: a restart "
                    "on spare nodes inside the allocation)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing while the job runs")
    c = sub.add_parser("cancel", help="cancel a run's job (a sweep: its workers); its folder stays")
    c.add_argument("run", help="a run folder, job id or name")
    rs = sub.add_parser("resubmit", help="submit a run again: same command, profile and folder; it resumes")
    rs.add_argument("run", help="a run folder, job id or name")
    rs.add_argument("overrides", nargs="*", help="built-in trainer overrides key=value (not model.*)")
    rs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a profile key")


def dispatch(ns: argparse.Namespace) -> int | None:
    """Run the tool ``ns`` names; None when it is not one of these."""
    if ns.command == "runs":
        from cluster.runs import show

        width = ns.width or shutil.get_terminal_size((120, 24)).columns
        return show(ns.state, ns.since, ns.pattern, ns.json, ns.trials, width)
    if ns.command == "status":
        from cluster.run_status import show as status

        return status(ns.run)
    if ns.command == "logs":
        from cluster.run_logs import show as logs
        from cluster.run_status import resolve
        from cluster.runs import LIVE, job_state_now

        record = resolve(ns.run)

        def alive() -> bool:  # Slurm not answering is no proof of an end: keep following
            state = job_state_now(str(record["job_id"]))
            return state is None or LIVE.get(state) is not None

        return logs(record, ns.rank, ns.attempt, ns.follow, alive)
    if ns.command == "cancel":
        from cluster.run_actions import cancel

        return cancel(ns.run)
    if ns.command == "resubmit":
        from cluster.run_actions import resubmit

        return resubmit(ns.run, ns.overrides, ns.set)
    return None
