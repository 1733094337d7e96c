"""The submitit tasks: the built-in trainer, or a user's command, in each Slurm task.

Neither requeues by itself: a save after a signal ends the task with exit 75 (rank 0 leaves the requeue marker)
and the batch script's teardown applies the one requeue rule (cluster/launch/render.py ``requeue_rule``). submitit's
own USR2 handler, which would requeue on its own terms, is replaced before anything runs.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from trainer.core.errors import EXIT_BAD_INPUT, EXIT_REQUEUE, UserError, record_end, record_failure


def _leave_requeue_to_the_batch_script() -> None:
    # submitit installed a USR2 handler that checkpoints and requeues; the warning now only reaches the training
    # code (the session's handler, or the command, which gets Slurm's signal itself).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _announce() -> None:
    # submitit keeps one log per task across attempts: the batch shell's line, in each of them, splits the attempts
    # (`python -m cluster logs --attempt K`).
    line = (f"attempt {os.environ.get('SLURM_RESTART_COUNT', '0')} of job {os.environ.get('SLURM_JOB_ID', '0')} starts "
            f"on {os.environ.get('SLURMD_NODENAME', '?')}")
    print(line, flush=True)
    print(line, file=sys.stderr, flush=True)


def _requeue_exit() -> None:
    # Leaving without a result keeps the submitting side waiting for the requeued run's result.
    sys.exit(EXIT_REQUEUE)


class TrainTask:
    """``python -m trainer ARGS`` as a submitit job; its state lives in the run folder, not in this object."""

    def __init__(self, args: list[str]) -> None:
        self.args = args

    def __call__(self) -> dict[str, Any]:
        from trainer.__main__ import run

        _leave_requeue_to_the_batch_script()
        _announce()
        args = self.args
        try:
            result = run(args)
        except UserError as err:  # shown by job.result() on the submitting side, without a deep traceback
            record_end(EXIT_BAD_INPUT)
            raise RuntimeError(err.render()) from None
        except Exception as exc:  # the exit record for the batch shell's verdict, as `python -m trainer` leaves it
            if record_failure(exc)["echo"]:
                raise RuntimeError("stopped: lost a peer (see the batch log for the first cause)") from None
            raise
        record_end(int(result["exit_code"]))
        if result["exit_code"] == EXIT_REQUEUE:
            _requeue_exit()
        return result


class CommandTask:
    """A user's command in each task, through :func:`trainer.launch.run` (torchrun's variables, the warning signal)."""

    def __init__(self, argv: list[str], warning: str, requeue_after: float | None) -> None:
        self.argv, self.warning, self.requeue_after = argv, warning, requeue_after

    def __call__(self) -> dict[str, Any]:
        from trainer.launch import run

        _leave_requeue_to_the_batch_script()
        _announce()
        try:
            rc = run(self.argv, self.warning, self.requeue_after)
        except UserError as err:
            raise RuntimeError(err.render()) from None
        if rc == EXIT_REQUEUE:
            _requeue_exit()
        if rc:
            raise RuntimeError(f"the command exited with code {rc} (its output is in this task's log)")
        return {"exit_code": 0, "rank": int(os.environ.get("SLURM_PROCID", "0"))}
