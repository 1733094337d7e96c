"""``python -m cluster submit|render|sweep|sweep-status|sweep-dashboard|suspects|save-now`` and the run tools
``runs|status|logs|cancel|resubmit`` (cluster/runs_cli.py): what `make submit`, `make sweep`, `make runs` and the
template regeneration call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster import runs_cli, suspects
from cluster.command import Command
from cluster.profile import load_profile, node_range
from cluster.render import render_sbatch
from cluster.submit import submit
from cluster.sweep import run as run_sweep
from cluster.sweep_status import show_status
from trainer.core.errors import UserError, exit_code_of


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and submit, dry-run, render, sweep or show a sweep; exit 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="submit training (or any command: -- CMD ARGS…) to Slurm")
    s.add_argument("--cluster", default="dev", help="profile name in cluster/profiles, or a YAML path")
    s.add_argument("--nodes", help="override the profile's node count: N, or MIN-MAX for a job that may start smaller")
    s.add_argument("--launcher", default="submitit", help="submitit (default) or sbatch")
    s.add_argument("--dry-run", action="store_true", help="print the exact script; submit nothing")
    s.add_argument("--wait", action="store_true", help="wait for the job and print its result")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a profile key")
    s.add_argument("--module", help="run `python -m MODULE ARGS…` (the words after --) in every task")
    s.add_argument("args", nargs="*", help="training overrides key=value, or after -- a command: python train.py …")
    r = sub.add_parser("render", help="print the sbatch template for a profile (hand-run scripts in slurm/)")
    r.add_argument("--cluster", default="example-h100")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--command", dest="command_template", action="store_true",
                   help="the template for any command (slurm/run.sbatch)")
    w = sub.add_parser("sweep", help="submit a hyper-parameter sweep: an Optuna study, its workers one Slurm job array")
    w.add_argument("spec", help="sweep YAML, e.g. cluster/sweeps/example.yaml")
    w.add_argument("--dry-run", action="store_true", help="print the trials and the workers' script; submit nothing")
    w.add_argument("--wait", action="store_true", help="wait for every trial, print the table; exit 1 if one failed")
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile key (after the spec's profile:)")
    w.add_argument("--resume", metavar="SWEEP_DIR", help="add the spec's trials to this sweep's study (new workers)")
    st = sub.add_parser("sweep-status", help="print a sweep's trials ranked by its metric")
    st.add_argument("sweep_dir", nargs="?", help="a folder under sweeps/ (default: the newest)")
    sd = sub.add_parser("sweep-dashboard", help="optuna-dashboard on a sweep's study, on this machine only")
    sd.add_argument("sweep_dir", nargs="?", help="a folder under sweeps/ (default: the newest)")
    sd.add_argument("--port", type=int, default=8080)
    sp = sub.add_parser("suspects", help="the evidence jobs left against nodes and which nodes new jobs avoid; or clear one")
    sp.add_argument("--clear", metavar="NODE", help="forget NODE's evidence (all: every node's)")
    sp.add_argument("--cluster", default="dev", help="the profile whose suspect_after applies (default: dev)")
    sn = sub.add_parser("save-now", help="ask a running job to save a checkpoint at its next poll, and go on")
    sn.add_argument("run_dir", help="the run folder (runs/<job id>)")
    runs_cli.add_parsers(sub)
    ns = parser.parse_args(argv)
    return exit_code_of(lambda: _dispatch(ns))


def _dispatch(ns: argparse.Namespace) -> int:
    done = runs_cli.dispatch(ns)
    if done is not None:
        return done
    if ns.command == "sweep-status":
        return show_status(ns.sweep_dir)
    if ns.command == "sweep-dashboard":
        from cluster.dashboard import serve

        return serve(ns.sweep_dir, ns.port)
    if ns.command == "save-now":
        return save_now(Path(ns.run_dir))
    if ns.command == "suspects":
        return suspects.show(Path(suspects.default_path()), ns.clear, load_profile(ns.cluster).suspect_after)
    bad = [kv for kv in ns.set if "=" not in kv or kv.startswith("=")]
    if bad:
        raise UserError("--set", f"{bad[0]!r} is not KEY=VALUE", "e.g. --set nodes=1")
    overrides: dict[str, object] = dict(kv.split("=", 1) for kv in ns.set)
    if ns.command == "sweep":
        return run_sweep(ns.spec, overrides, ns.dry_run, ns.wait, ns.resume)
    if ns.command == "render":
        p = load_profile(ns.cluster, overrides)
        sets = "".join(f" --set {kv}" for kv in ns.set) + (" --command" if ns.command_template else "")
        usage = "COMMAND [ARG ...]` (e.g. python train.py --lr 0.1)" if ns.command_template else "[key=value ...]`"
        origin = (f"Hand-run template: activate the venv, then `sbatch THIS_FILE {usage} (sbatch options such as "
                  f"--nodes=1 override the lines below).\n# Made by `python -m cluster render --cluster {ns.cluster}{sets}`: "
                  "edit the profile and regenerate rather than editing by hand.")
        print(render_sbatch(p, "python", [], origin, command=Command(()) if ns.command_template else None), end="")
        return 0
    if ns.nodes is not None:
        overrides.update(node_range(ns.nodes))
    asked = {"cluster": ns.cluster, "set": ns.set, "nodes_arg": ns.nodes}  # for `resubmit`
    return submit(load_profile(ns.cluster, overrides), ns.args, ns.launcher, ns.dry_run, ns.wait, ns.module, asked)


def save_now(run_dir: Path) -> int:
    """Leave ``save-now`` in a run folder: rank 0 sees it within ``checkpoint.poll_steps`` steps, all ranks save."""
    if not (run_dir / "config.yaml").is_file():
        raise UserError("RUN_DIR", f"{run_dir} is not a run folder (no config.yaml)", "pass runs/<job id> of a running job")
    (run_dir / "save-now").touch()
    print(f"asked {run_dir} to save at its next poll (checkpoint.poll_steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
