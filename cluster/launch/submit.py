"""Submit training to Slurm through submitit (default) or a rendered sbatch script."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.job import ledger, nodes, suspects
from cluster.launch.command import Command, parse, requeue_after
from cluster.launch.render import (
    container_prefix,
    doctor_step,
    dq,
    flight_recorder,
    host_python,
    render_sbatch,
    requeue_rule,
    run_dir_lines,
)
from cluster.launch.submitit_adapter import renderable, submission_text
from cluster.launch.task import CommandTask, TrainTask
from cluster.profile import Profile
from trainer.core.errors import UserError
from trainer.core.legacy import LEGACY
from trainer.runtime.batches import check_worlds

if TYPE_CHECKING:
    from trainer.core.config import Config


def python_for(p: Profile) -> str:
    """The interpreter the compute nodes run: the profile's, or the one submitting (same venv)."""
    return sys.executable if p.python == "python" else p.python


def split_run_dir(args: list[str]) -> tuple[list[str], str | None]:
    """Take ``run.dir=…`` out of the overrides: the batch script owns it (as RUN_DIR) to find requeue markers."""
    rest = [a for a in args if not a.startswith("run.dir=")]
    dirs = [a.split("=", 1)[1] for a in args if a.startswith("run.dir=")]
    return rest, (dirs[-1] if dirs else None)


def sbatch_script(p: Profile, args: list[str], command: Command | None = None) -> str:
    """The script `LAUNCHER=sbatch` submits: the built-in trainer with overrides ``args``, or ``command``."""
    rest, run_dir = split_run_dir(args) if command is None else ([], None)
    return render_sbatch(p, python_for(p), rest, f"rendered from profile {p.name!r} by `python -m cluster submit`",
                         run_dir=run_dir, command=command)


def executor(p: Profile, run_dir: str | None = None, args: list[str] | None = None, command: bool = False) -> Any:
    """A submitit Slurm executor configured from the profile (``run_dir``: the trainer's, when given; ``args``:
    the training overrides, which the optional preflight doctor checks with)."""
    import submitit

    if p.spare_nodes:
        raise UserError("profile.spare_nodes", "needs the sbatch launcher (submitit starts its tasks itself, on every "
                        "node of the job)", "LAUNCHER=sbatch, or spare_nodes: 0")
    if p.min_nodes and p.min_nodes < p.nodes:
        raise UserError("profile.min_nodes", f"a node range ({p.node_range}) needs the sbatch launcher: submitit asks "
                        "for a fixed node count and waits for a result from each of its nodes × tasks_per_node tasks",
                        f"LAUNCHER=sbatch, or NODES={p.nodes}")
    folder = Path(p.log_dir) / "%j"
    inside = container_prefix(p)
    # slurm_max_num_timeout=0: submitit's own requeueing is off (the tasks replace its handler); the teardown
    # below applies the same requeue rule as an sbatch script, in the batch shell, outside any container.
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=0,
                               slurm_python=f"{inside} python3" if inside else python_for(p))
    setup = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(p.env.items())] + list(p.setup)
    setup += [f"export TRAINER_MTBF_HOURS={p.mtbf_hours:g}"] if p.mtbf_hours != 24 else []
    setup += flight_recorder(p, f"{dq(str(Path(p.log_dir).resolve()))}/$SLURM_JOB_ID")
    setup += run_dir_lines(shlex.quote(run_dir) if run_dir else "runs/$SLURM_JOB_ID", "USR2",  # submitit warns with USR2
                           p.signal_grace_s)
    host = host_python(p, python_for(p))
    teardown = ["rc=$?  # the tasks' exit code (srun's, the line above)",
                *requeue_rule(p, host, report=command and not inside)]
    py = "python3" if inside else shlex.quote(python_for(p))
    doctor = f"srun --kill-on-bad-exit=1 {inside + ' ' if inside else ''}{py} -m trainer.doctor"
    doctor += "".join(f" {shlex.quote(a)}" for a in split_run_dir(args or [])[0])
    setup += doctor_step(p, [doctor], host)
    params: dict[str, Any] = {
        "name": p.job_name,
        "nodes": p.nodes,
        "tasks_per_node": p.ntasks_per_node,
        "cpus_per_task": p.cpus_per_task,
        "timeout_min": p.time_min,
        "slurm_signal_delay_s": p.signal_grace_s,
        "slurm_srun_args": ["--kill-on-bad-exit=1"],
        "slurm_setup": setup,
        "slurm_additional_parameters": {"requeue": "expedite" if p.requeue_expedite == "yes" else True},
        "slurm_teardown": teardown,
    }
    if p.gpus_per_node:
        params["gpus_per_node"] = p.gpus_per_node
    if p.mem_per_task_gb:
        params["mem_gb"] = p.mem_per_task_gb * p.ntasks_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(p, key):
            params[f"slurm_{key}"] = getattr(p, key)
    ex.update_parameters(**params)
    return ex


def submitit_script(p: Profile, args: list[str], command: Command | None = None) -> str:
    """The exact batch script submitit would submit for this profile (its submission file text)."""
    with renderable():
        ex = executor(p, split_run_dir(args)[1], args) if command is None else executor(p, command=True)
    return submission_text(ex)


def suspect_nodes(p: Profile) -> list[str]:
    """The nodes other jobs' evidence avoids (cluster/job/suspects.py), which a new job excludes, as long as the
    partition keeps enough nodes for it; the least suspect are used again otherwise (fail open), said in one line."""
    ordered = suspects.active(Path(suspects.default_path()), p.suspect_after)
    if not ordered:
        return []
    need = (p.min_nodes if p.ranged else p.nodes) + p.spare_nodes
    avoid, again = suspects.fail_open(ordered, nodes.usable(p.partition) or set(), need)
    if avoid:
        print(f"excluding suspect node(s) {', '.join(avoid)} (`python -m cluster suspects` shows the evidence, "
              "--clear NODE forgets it)")
    if again:
        print(f"using suspect node(s) {', '.join(again)} again: excluding them too would leave fewer than {need} "
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


def submit(p: Profile, args: list[str], launcher: str, dry_run: bool, wait: bool, module: str | None = None,
           origin: dict[str, Any] | None = None) -> int:
    """Submit (or with dry_run print) one job: the built-in trainer with overrides ``args``, or the command in
    ``args`` (``module``: ``python -m module args``); with wait, block and report the result. ``origin``: how it was
    asked for (profile name, ``--set``, …), kept in the ledger so that ``resubmit`` can ask again."""
    if launcher not in ("submitit", "sbatch"):
        raise UserError("LAUNCHER", f"must be submitit or sbatch, got {launcher!r}", "LAUNCHER=sbatch or leave it unset")
    # A container or another interpreter has packages of its own: only this one's imports are checked here.
    command = parse(args, module, check_import=p.container.runtime == "none" and python_for(p) == sys.executable)
    if command is None:
        _check_trainer_args(args, "SIGUSR2" if launcher == "submitit" else f"SIG{p.signal}", p)
    if launcher == "submitit" and (p.signal != "USR2" or p.launch != "srun"):
        raise UserError("profile.signal" if p.signal != "USR2" else "profile.launch",
                        "submitit always warns with USR2 and starts one task per process",
                        "use signal: USR2 and launch: srun with submitit, or LAUNCHER=sbatch")
    if p.signal_grace_s == 0 and (launcher == "submitit" or p.requeue_on_signal):
        raise UserError("profile.signal_grace_s", "0 (no warning signal) needs the sbatch launcher, and a command that "
                        "saves itself: submitit always warns, and requeue_on_signal stops a command on the warning",
                        "signal_grace_s: 120 (time for one save), or LAUNCHER=sbatch without requeue_on_signal")
    if dry_run:
        print(sbatch_script(p, args, command) if launcher == "sbatch" else submitit_script(p, args, command), end="")
        if launcher == "submitit":  # the task itself travels as a pickle, not in the script
            print(f"# each task runs: {task_line(p, args, command)}", file=sys.stderr)
        return 0
    check_slurm()
    check_fits(p)
    if p.requeue_expedite == "auto":  # decided here, where Slurm can be asked: the script says what was decided
        p.requeue_expedite = "yes" if nodes.offers_expedited_requeue() else "no"
    Path(p.log_dir).mkdir(parents=True, exist_ok=True)
    entry = {"kind": "job", "name": p.job_name, "launcher": launcher, "profile": p.name, "nodes": p.node_range,
             "args": list(args), "module": module, "command": None if command is None else list(command.argv),
             **(origin or {})}
    if launcher == "sbatch":
        return _submit_sbatch(p, args, command, wait, entry)
    return _submit_submitit(p, args, command, wait, entry)


def _record(entry: dict[str, Any], job_id: str, args: list[str], log: str) -> None:
    """The ledger's record of a submitted job (before waiting for it): where its run folder and logs are."""
    run_dir = os.environ.get("RUN_DIR") or split_run_dir(args)[1] or f"runs/{job_id}"
    try:
        ledger.write({**entry, "job_id": job_id, "run_dir": str(Path(run_dir).resolve()), "log": str(Path(log).resolve())})
    except OSError as err:  # the job is submitted; only `runs` will not know it
        print(f"warning: could not record job {job_id} in {ledger.folder()}: {err}", file=sys.stderr)


def _check_trainer_args(args: list[str], warned_with: str, p: Profile) -> None:
    """Bad overrides fail here, not on the cluster. The job's warning signal is the profile's, not a trainer key."""
    for arg in args:
        key = arg.partition("=")[0]
        if key == "checkpoint.signal":
            raise UserError(key, "is no longer a key: the trainer saves on the signal the job is warned "
                            f"with ({warned_with}, the profile's signal), and on SIGUSR2 and SIGTERM",
                            "leave it out; another signal: --set signal=USR1 (SET=\"signal=USR1\")")
        if key in LEGACY:
            raise UserError(key, f"is no longer a key ({LEGACY[key][1]})", f"leave {arg!r} out")
    from trainer.builtin.build import checked  # torch: never loaded to list or render

    cfg, params = checked([a for a in args if not a.startswith("run.dir=")])
    if cfg.data.global_batch_size:  # now, not after the queue wait: every world size the job may start with
        check_worlds(cfg.data.global_batch_size, p.world_sizes(), cfg.data.batch_size)
    check_snapshot_room(p, cfg, params)


def check_snapshot_room(p: Profile, cfg: Config, params: int | None) -> None:
    """Memory snapshots that the nodes' /dev/shm (by default half their memory) cannot hold: refused with the
    figures when asked for (checkpoint.memory=on), one note for auto; nothing when sinfo or the model cannot say."""
    wanted = cfg.checkpoint.memory == "on" or (cfg.checkpoint.memory == "auto" and p.in_place)
    mem = nodes.memory_mb(p.partition) if wanted and params else None
    if not mem or not params:
        return
    state = params * 4 * (1 + (2 if cfg.optim.name == "adamw" else 1))  # fp32 weights, optimizer moments
    world = p.nodes * p.ntasks_per_node
    share = 2 * p.ntasks_per_node / world if cfg.dist.strategy == "fsdp" and world > p.ntasks_per_node else 1.0
    need, room = 2 * state * share, mem * 2**20 / 2  # two snapshots kept; fsdp: this node's shards and a partner's
    if need <= room:
        return
    what = (f"memory snapshots need about {need / 2**30:.1f} GiB of /dev/shm on each node, and the nodes of "
            f"{p.partition or 'the cluster'} have {mem / 1024:.1f} GiB of memory (/dev/shm: usually half)")
    if cfg.checkpoint.memory == "on":
        raise UserError("checkpoint.memory", what, "checkpoint.memory=off, or dist.strategy=fsdp on more nodes "
                        "(each node then holds less)")
    print(f"note: {what}: the job goes without them (checkpoint.memory=auto)")


def task_line(p: Profile, args: list[str], command: Command | None) -> str:
    """What each submitit task runs, as a command line (for dry runs)."""
    if command is None:
        return f"python -m trainer {shlex.join(args)}"
    return f"python -m trainer.launch {shlex.join([*command.launch_args(p), *command.argv])}"


def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a log (empty when it does not exist)."""
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def _submit_sbatch(p: Profile, args: list[str], command: Command | None, wait: bool, entry: dict[str, Any]) -> int:
    script = sbatch_script(p, args, command)
    avoid = suspect_nodes(p)
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *([f"--exclude={','.join(avoid)}"] if avoid else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(script)
    proc.stdin.close()
    job_id = proc.stdout.readline().strip().split(";")[0]
    if not job_id:
        proc.wait()
        print(f"sbatch refused the job (exit {proc.returncode}); its message is above", file=sys.stderr)
        return proc.returncode or 1
    log = Path(p.log_dir) / f"{p.job_name}-{job_id}.out"
    _record(entry, job_id, [] if command else args, str(log))
    what = f"command: {command}, " if command else ""
    spare = f" + {p.spare_nodes} spare" if p.spare_nodes else ""
    print(f"submitted job {job_id} (sbatch, {what}{p.nodes}{spare} node(s), profile {p.name})")
    print(f"log:    {log}\nfollow: tail -f {shlex.quote(str(log))}    status: squeue -j {job_id}")
    rc = proc.wait()
    if wait:
        print(f"job {job_id} ended with exit code {rc}; the log's last lines:")
        print(tail(log), end="")
    return rc


def _submit_submitit(p: Profile, args: list[str], command: Command | None, wait: bool, entry: dict[str, Any]) -> int:
    ex = executor(p, split_run_dir(args)[1], args) if command is None else executor(p, command=True)
    avoid = suspect_nodes(p)
    if avoid:
        ex.update_parameters(slurm_exclude=",".join(avoid))
    task: TrainTask | CommandTask = (
        TrainTask(list(args)) if command is None
        else CommandTask(list(command.argv), p.signal, requeue_after(p) if p.requeue_on_signal else None))
    job = ex.submit(task)
    _record(entry, str(job.job_id), [] if command else args, str(Path(job.paths.stdout).parent))
    what = f"command: {command}, " if command else ""
    print(f"submitted job {job.job_id} (submitit, {what}{p.nodes} node(s), profile {p.name})")
    print(f"logs:   {job.paths.stdout} (rank 0), {job.paths.stderr}")
    print(f"follow: tail -f {shlex.quote(str(job.paths.stdout))}    status: squeue -j {job.job_id}")
    if not wait:
        return 0
    try:
        results = job.results()
    except Exception as exc:  # submitit re-raises the task's error with its log
        errors = [line for line in str(exc).splitlines() if "Error:" in line]  # the task's own error, not the trace
        print(f"job {job.job_id} failed: {errors[-1].strip() if errors else exc}", file=sys.stderr)
        for path in (job.paths.stdout, job.paths.stderr):
            print(f"--- last lines of {path}", file=sys.stderr)
            print(tail(Path(path)), end="", file=sys.stderr)
        return 1
    if command is not None:
        print(f"job {job.job_id} done: the command exited 0 on {len(results)} task(s)")
        return 0
    main = results[0]
    scores = ", ".join(f"{k[5:]} {v:.4g}" for k, v in main.items() if k.startswith("test_")) or "no evaluation set"
    print(f"job {job.job_id} done: {scores}, world size {main['world_size']}, checkpoint {main['checkpoint']}")
    for r in results:
        checksum = f", parameter checksum {r['param_checksums'][r['rank']]}" if "param_checksums" in r else ""
        print(f"  rank {r['rank']}: world size {r['world_size']}{checksum}")
    return 0


def load_train_config(args: list[str]) -> Config:
    """The built-in trainer's checks of ``args`` (imported here: they load torch, which listing or rendering never
    needs)."""
    from trainer.builtin.build import load_checked

    return load_checked(args)
