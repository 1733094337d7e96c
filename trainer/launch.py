"""``python -m trainer.launch [--signal USR2] [--requeue-after S] [--torchrun N] -- CMD…``: one Slurm task of any command.

What `make submit CMD=…` runs in every task (and submitit's command task calls :func:`run`):

- the command gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
  computed by :mod:`trainer.core.env` from Slurm's, so an unmodified ``init_process_group()`` script runs on many nodes;
  with ``--torchrun N`` it is started by torchrun's agent instead (N processes on this node, c10d rendezvous);
- a leading ``python``/``python3`` word means this interpreter (the job's venv or image), not whatever PATH finds;
- the warning signal (USR1/USR2) starts out ignored in the command, so a script that does not handle it keeps
  training until the time limit; a script that does (the session API) saves and exits 75;
- ``--requeue-after S``: once warned, a command still running S seconds later is stopped and 75 returned, so the
  batch script requeues it (the profile's ``requeue_on_signal``);
- exit 75 on rank 0 also leaves ``$RUN_DIR/requeue.json``, which the batch script reads when srun or torchrun's
  agent reports another code. The requeue rule itself lives in the batch script (cluster/launch/render.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from trainer.core import exits
from trainer.core.env import DistEnv, discover, job_info, torchrun_environ
from trainer.core.errors import EXIT_BAD_INPUT, EXIT_REQUEUE, UserError, exit_code_of, record_end
from trainer.core.records import REQUEUE_MARKER, RequeueMarker

STOP_WAIT_S = 10.0
"""After stopping a command (TERM), seconds before it is killed."""

PYTHONS = ("python", "python3")

SELF_INFLICTED = {signal.SIGABRT, signal.SIGSEGV, signal.SIGFPE, signal.SIGILL}
"""Signals a process raises against itself: its own error. Any other (KILL from the OOM-killer, TERM, BUS) is the
node's."""


def command_argv(cmd: list[str], env: DistEnv, torchrun: int) -> list[str]:
    """The argv to start: ``python`` words replaced by this interpreter, wrapped in torchrun's agent when asked."""
    python = cmd[0] in PYTHONS
    if not torchrun:
        return [sys.executable, *cmd[1:]] if python else list(cmd)
    # torchrun takes a script or -m MODULE itself; interpreter options (-u, -c, -X …) go to the interpreter it runs
    plain = python and len(cmd) > 1 and (not cmd[1].startswith("-") or cmd[1] == "-m")
    cmd = [sys.executable, *cmd[1:]] if python and not plain else cmd
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={env.num_nodes}", f"--nproc-per-node={torchrun}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={env.master_addr}:{env.master_port}",
            f"--rdzv-id={env.job_id or 'local'}", *(cmd[1:] if plain else ["--no-python", *cmd])]


def command_environ(env: DistEnv, warning: signal.Signals, torchrun: int) -> dict[str, str]:
    """This process's environment plus the command's place in the job and the job's warning signal."""
    placed = {} if torchrun else torchrun_environ(env)  # torchrun's agent sets them for its own workers
    return {**os.environ, **placed, "TRAINER_SIGNAL": warning.name}


class Watch:
    """Signals to this wrapper, only noted: the command gets Slurm's signals itself (Slurm signals every process of
    the step; docker-task.sh has the container's init signal the whole process group)."""

    def __init__(self, warning: signal.Signals) -> None:
        self.warned_at: float | None = None
        self.warning = warning
        for sig in {warning, signal.SIGTERM, signal.SIGINT}:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if signum == self.warning and self.warned_at is None:
            self.warned_at = time.monotonic()


def _mark_requeue(env: DistEnv, reason: str) -> None:
    """Rank 0 leaves the requeue marker in $RUN_DIR (unless the command left its own)."""
    run_dir = job_info().run_dir
    if env.rank or env.node_rank or not run_dir:
        return
    if not (Path(run_dir) / REQUEUE_MARKER).exists():
        try:
            RequeueMarker(reason, by="trainer.launch").write(Path(run_dir))
        except OSError as exc:
            print(f"trainer.launch: cannot leave {Path(run_dir) / REQUEUE_MARKER} ({exc.strerror})", file=sys.stderr)


def run(cmd: list[str], warning: str = "USR2", requeue_after: float | None = None, torchrun: int = 0) -> int:
    """Start ``cmd`` as this task's share of the job and return its exit code (75: requeue)."""
    if not cmd:
        raise UserError("CMD", "no command given", "e.g. make submit CMD=\"python train.py --epochs 2\"")
    sig = signal.Signals[f"SIG{warning.removeprefix('SIG')}"]
    env = discover()
    if not torchrun:  # with torchrun's agent its workers are the ranks
        exits.started(env.rank)
    argv = command_argv(cmd, env, torchrun)
    watch = Watch(sig)
    ignore = sig in (signal.SIGUSR1, signal.SIGUSR2)  # their default action kills; TERM and INT keep theirs
    previous = signal.signal(sig, signal.SIG_IGN) if ignore else None  # inherited through exec as "ignored"
    try:
        child = subprocess.Popen(argv, env=command_environ(env, sig, torchrun))
    except OSError as exc:
        if not torchrun:  # its start record must not read as killed by a signal: the node's fault, retried, blamed
            record_end(EXIT_BAD_INPUT, rank=env.rank, cause=f"the command cannot start: {argv[0]} ({exc.strerror})")
        raise UserError("CMD", f"cannot start {argv[0]!r} ({exc.strerror})",
                        "give a program on PATH on the compute nodes, or a path relative to the submit folder") from None
    finally:
        if previous is not None:
            signal.signal(sig, watch._note)
    stopped = False
    while True:
        try:
            rc = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if (requeue_after is not None and watch.warned_at is not None and not stopped
                and time.monotonic() - watch.warned_at >= requeue_after):
            print(f"trainer.launch: still running {requeue_after:g} s after {sig.name}: stopping it for a requeue",
                  file=sys.stderr, flush=True)
            stopped = True
            child.terminate()
            try:
                child.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
    if stopped:
        rc = EXIT_REQUEUE
    if rc == EXIT_REQUEUE:
        _mark_requeue(env, "stopped after the warning signal" if stopped else "the command exited 75")
    if not torchrun:
        _record(env.rank, rc)
    return rc if rc >= 0 else 128 - rc  # killed by signal N: the shell's 128+N


def _record(rank: int, rc: int) -> None:
    """The command's exit record, unless it wrote its own (a session script): its contract is 0 finished, 75 saved
    for a requeue, killed by a signal the node's fault (the OOM-killer, a dying node), anything else its own error."""
    path = exits.record_path("train", rank)
    try:
        if path is None or json.loads(path.read_text()).get("code") is not None:
            return
    except (OSError, ValueError):
        pass
    signum = -rc if rc < 0 else rc - 128 if rc - 128 in (signal.SIGKILL, signal.SIGBUS, *SELF_INFLICTED) else 0
    how = "" if rc < 0 else f" (exit {rc}: a shell's child)"  # `bash train.sh` exits 128+N for a child killed by N
    if not signum:
        record_end(rc, rank=rank, cause=f"the command exited {rc}")
    elif signum in SELF_INFLICTED:  # the process's own crash (abort(), a bad pointer), not the node's
        exits.ended(128 + signum, exits.outcome(exits.USER_ERROR, f"the command crashed ({signal.Signals(signum).name})"
                                                f"{how}", aborted=signum == signal.SIGABRT), rank=rank)
    else:  # TERM/INT come from srun ending the step or from scancel: echoes; KILL, BUS … the node's
        exits.ended(128 + signum, exits.outcome(exits.INFRASTRUCTURE, f"the command was killed by "
                                                f"{signal.Signals(signum).name}{how}",
                                                echo=signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)), rank=rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--signal", default="USR2", help="the signal Slurm warns the job with (profile signal)")
    parser.add_argument("--requeue-after", type=float, default=None, metavar="S",
                        help="stop a command still running S seconds after the warning, and return 75")
    parser.add_argument("--torchrun", type=int, default=0, metavar="N", help="start N processes with torchrun's agent")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    ns = parser.parse_args(argv)
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    return exit_code_of(lambda: _start(cmd, ns))


def _start(cmd: list[str], ns: argparse.Namespace) -> int:
    if ns.signal.removeprefix("SIG") not in ("USR1", "USR2", "TERM", "INT", "HUP"):
        raise UserError("--signal", f"unsupported signal {ns.signal!r}", "USR2 (the profiles' default)")
    return run(cmd, ns.signal, ns.requeue_after, ns.torchrun)


if __name__ == "__main__":
    sys.exit(main())
