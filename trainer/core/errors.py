"""User-facing errors: one line naming the field, one HINT line, exit code 2."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from trainer.core import exits

EXIT_BAD_INPUT = 2
"""Exit code for bad configuration or environment: nothing was written."""

EXIT_REQUEUE = 75
"""Exit code for "checkpoint saved after a preemption signal, please requeue" (EX_TEMPFAIL)."""


def exit_now(code: int) -> NoReturn:
    """End a finished process with ``code`` without interpreter finalization (for ``__main__`` blocks only).

    After the last collective, gloo's worker threads may still be dropping its work, whose tensors need the
    GIL to be freed. A thread that asks for the GIL while the interpreter finalizes is ended by pthread_exit
    inside a noexcept destructor, and the process aborts (SIGABRT, "terminate called without an active
    exception") after a run that finished: once in about 40 two-process CPU runs here (core dump:
    ~AsyncBarrierWork → ~AsyncAllgatherWork → a tensor's Python decref → take_gil → pthread_exit).
    Everything has been written and closed by then; only stdout and stderr are left to flush.
    """
    for fn in reversed(_at_exit):  # what the skipped exit handlers would have done that outlives the process
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the exit code stands; say what was left
            print(f"warning: at exit, {getattr(fn, '__qualname__', fn)}: {exc}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_at_exit: list[Callable[[], None]] = []


def at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` in :func:`exit_now`, which skips the interpreter's exit handlers and finalizers (once per ``fn``)."""
    if fn not in _at_exit:
        _at_exit.append(fn)


class UserError(Exception):
    """A problem the user can fix; printed as ``error: <field>: <message>`` plus ``HINT: <hint>``."""

    def __init__(self, field: str, message: str, hint: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.hint = hint

    def render(self) -> str:
        """Two lines for stderr: the error and how to fix it."""
        return f"error: {self.field}: {self.message}\nHINT: {self.hint}"


def exit_code_of(fn: Callable[[], int]) -> int:
    """``fn()``'s exit code; a UserError prints ``error: …`` and ``HINT: …`` (no traceback) and gives 2."""
    try:
        return fn()
    except UserError as err:
        print(err.render(), file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


def recorded(fn: Callable[[], int], phase: str = "train") -> int:
    """``fn()``'s exit code, and this rank's exit record (trainer/core/exits.py) saying how it ended. A rank that
    stopped because a peer went away says so in one line, without a traceback: its end is an echo, not a cause."""
    try:
        code = exit_code_of(fn)
    except SystemExit as exc:  # sys.exit(n) in the user's function
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever the loop was
        exits.ended(exits.EXIT_INTERRUPTED, exits.interrupted(), phase=phase)
        print(f"{exits.node_name()}: interrupted (SIGINT)", file=sys.stderr, flush=True)
        return exits.EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - classified, recorded, then shown once
        if not record_failure(exc, phase)["echo"]:
            traceback.print_exc()
        return 1
    record_end(code, phase)
    return code


def record_end(code: int, phase: str = "train", rank: int | None = None, cause: str | None = None) -> None:
    """Record a process that returned ``code``: 0 finished, 75 saved for a requeue, 2 bad input, else its error."""
    kind = {0: exits.FINISHED, EXIT_REQUEUE: exits.PREEMPTED}.get(code, exits.USER_ERROR)
    cause = cause or ("bad input (its error: and HINT: are in the log)" if code == EXIT_BAD_INPUT else f"exit {code}")
    exits.ended(code, exits.outcome(kind, cause), phase=phase, rank=rank)


def record_failure(exc: BaseException, phase: str = "train") -> dict[str, object]:
    """Record a process ended by ``exc`` and return its class; a lost peer (an echo) is announced in one line."""
    info = exits.classify(exc)
    exits.ended(1, info, phase=phase)
    if info["echo"]:
        print(f"{exits.node_name()}: rank {os.environ.get('RANK') or os.environ.get('SLURM_PROCID', '0')} stopped: "
              f"{info['cause']}; {exits.first_failure() or 'the batch log names the first cause'}",
              file=sys.stderr, flush=True)
    return info


def main(fn: Callable[[], int]) -> NoReturn:
    """Run ``fn()`` and exit with what it returns (``Session.finish()``: 0, or 75 to be requeued); a UserError
    prints ``error: …`` and ``HINT: …`` and exits 2, without a traceback; any other error is recorded for the
    batch shell's verdict (retry or not) and exits 1."""
    exit_now(recorded(fn))
