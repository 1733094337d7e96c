"""Preemption signals: a handler that only sets a flag, which the save policy's poll turns into one agreed save at a
step boundary (never acted on in the handler: it may interrupt a write)."""

from __future__ import annotations

import signal


class Preemption:
    """Sets a flag when a preemption signal arrives; the loop acts on it at the next step boundary."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signum = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum  # no I/O in a handler: it may interrupt a write

    def restore(self) -> None:
        """Put back the handlers that were there before (e.g. submitit's)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def saving_signals(warning: str | None) -> tuple[signal.Signals, ...]:
    """The signals a session saves on: USR2, TERM, and the job's warning signal (TRAINER_SIGNAL, from the batch script
    or `python -m trainer.launch`), e.g. ``SIGUSR1``."""
    warned = [signal.Signals[warning]] if warning and warning in signal.Signals.__members__ else []
    return tuple({signal.SIGUSR2, signal.SIGTERM, *warned})
