"""User-facing errors: one line naming the field, one HINT line, exit code 2."""

from __future__ import annotations

EXIT_BAD_INPUT = 2
"""Exit code for bad configuration or environment: nothing was written."""

EXIT_REQUEUE = 75
"""Exit code for "checkpoint saved after a preemption signal, please requeue" (EX_TEMPFAIL)."""


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
