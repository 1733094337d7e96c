"""How a training script ends: its exit code for the launcher, bad input as two lines and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from trainer.errors import EXIT_BAD_INPUT, UserError, exit_now


def main(fn: Callable[[], int]) -> NoReturn:
    """Run ``fn()`` and exit with what it returns (``Session.finish()``: 0, or 75 to be requeued); a UserError
    prints ``error: …`` and ``HINT: …`` and exits 2, without a traceback."""
    try:
        code = fn()
    except UserError as err:
        print(err.render(), file=sys.stderr, flush=True)
        code = EXIT_BAD_INPUT
    exit_now(code)
