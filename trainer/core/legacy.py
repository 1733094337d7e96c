"""Configuration keys of earlier versions whose facts moved to the environment. A batch script written then and
requeued now still passes them: each is taken as the variable that replaced it, with a one-line note."""

from __future__ import annotations

import os
import signal

from trainer.core.errors import UserError

LEGACY = {
    "checkpoint.signal": ("TRAINER_SIGNAL", "the job's warning signal comes from the launcher (TRAINER_SIGNAL, the "
                          "profile's signal); SIGUSR2 and SIGTERM always save"),
    "train.checksum": ("TRAINER_CHECKSUM", "parameter checksums in result.json are asked for with TRAINER_CHECKSUM=1"),
}
"""Keys that launchers injected and a test switch, before their facts moved to the environment: a batch script
written then and requeued now still passes them. Each is taken as its variable (unless already set), with a note."""

deprecations: list[str] = []
"""The notes of the legacy keys this process read; the session prints them once, on rank 0."""


def take_legacy(key: str, value: str) -> None:
    """Take ``key=value`` of an earlier version as the variable that replaced it, and note it."""
    variable, why = LEGACY[key]
    if key == "checkpoint.signal":
        sig = getattr(signal, value if value.startswith("SIG") else f"SIG{value}", None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise UserError(key, f"unknown signal {value!r}", "leave it out: the launcher sets TRAINER_SIGNAL")
        value = sig.name
    else:
        value = "1" if value.lower() in ("1", "true", "yes") else "0"
    if not os.environ.get(variable):  # the launcher's own word wins
        os.environ[variable] = value
    deprecations.append(f"note: {key} is no longer a key ({why}); taken as {variable}={os.environ[variable]}")
