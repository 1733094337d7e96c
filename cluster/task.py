"""The submitit task: runs the trainer in each Slurm task and requeues after a signalled save."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from typing import Any

import submitit

from trainer.errors import EXIT_REQUEUE, UserError


class TrainTask(submitit.helpers.Checkpointable):
    """``python -m trainer ARGS`` as a submitit job; its state lives in the run folder, not in this object."""

    def __init__(self, args: list[str], max_requeues: int) -> None:
        self.args = args
        self.max_requeues = max_requeues

    def __call__(self) -> dict[str, Any]:
        from trainer.__main__ import run

        args = self.args
        if os.environ.get("RUN_DIR") and not any(a.startswith("run.dir=") for a in args):
            args = [*args, f"run.dir={os.environ['RUN_DIR']}"]  # the folder the batch shell watches (containers)
        try:
            result = run(args)
        except UserError as err:  # shown by job.result() on the submitting side, without a deep traceback
            raise RuntimeError(err.render()) from None
        if result["exit_code"] != EXIT_REQUEUE:
            return result
        # The trainer saved at a step boundary after a signal. A TERM comes from Slurm ending or requeueing
        # the job itself: nothing to do. Our own warning signal (USR2) asks us to requeue: submitit's handler,
        # which the trainer put back, calls checkpoint() and `scontrol requeue` on rank 0 and exits there.
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if result["signal"] != "SIGTERM":
            if restarts >= self.max_requeues:
                raise RuntimeError(f"checkpoint saved, but not requeued: {restarts} requeues done (max_requeues)")
            handler = signal.getsignal(signal.SIGUSR2)
            # Inside an image without scontrol, the batch script's teardown requeues (it sees requeue.json).
            if callable(handler) and shutil.which("scontrol"):
                handler(signal.SIGUSR2, None)
        # Leaving without a result keeps the client waiting for the requeued run's result.
        sys.exit(EXIT_REQUEUE)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Requeue the same task: on restart the trainer resumes from the run folder's newest checkpoint."""
        return submitit.helpers.DelayedSubmission(TrainTask(self.args, self.max_requeues))
