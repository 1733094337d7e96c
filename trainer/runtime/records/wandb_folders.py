"""wandb's two temporary folders, made in TMPDIR when it is imported and removed by finalizers at interpreter exit,
which a rank skips (it ends with os._exit: trainer/core/errors.py ``exit_now``). The one place that knows their private
names (tests/test_tracking.py pins them); a later wandb without them leaves the folders, as before."""

from __future__ import annotations

import contextlib
import sys
import tempfile

PLACES = (("wandb.sdk.data_types._private", "MEDIA_TMP"), ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"))
"""(module, attribute path) of each ``tempfile.TemporaryDirectory`` wandb makes at import."""


def folders() -> list[tempfile.TemporaryDirectory[str]]:
    """The temporary folders of the wandb this process imported (none when it did not)."""
    found = []
    for module, path in PLACES:
        here: object = sys.modules.get(module)
        for name in path.split("."):
            here = getattr(here, name, None)
        if isinstance(here, tempfile.TemporaryDirectory):
            found.append(here)
    return found


def remove() -> None:
    """Remove them now (at the process's end: the run is finished, nothing stages files there any more)."""
    for folder in folders():
        with contextlib.suppress(OSError):
            folder.cleanup()
