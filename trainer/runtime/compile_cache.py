"""torch.compile's kernel cache kept in the run folder, so that a requeued or recovered attempt, on any node, loads
what an earlier attempt compiled instead of compiling it again (GPT-2 small on an H200: a first step of 21.2 s cold,
3.2 s from the run folder's cache; docs/benchmarks.md section 4).

Inductor's default cache is ``/tmp/torchinductor_$USER``: node-local, and gone with the container or the node. Its
writes are atomic (a temporary file renamed), so the ranks of every node may share one folder. A cache the user chose
(``TORCHINDUCTOR_CACHE_DIR`` set to anything but inductor's default) is left alone. Triton's kernels go inside it
unless ``TRITON_CACHE_DIR`` says otherwise.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from pathlib import Path

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def default() -> str:
    """Inductor's own default folder (torch._inductor.runtime.cache_dir_utils.default_cache_dir, private: pinned by
    tests/test_session.py): importing torch._dynamo (DDP, an optimizer) writes it into the variable, so a variable
    that holds it was not the user's choice."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def chosen_by_user() -> bool:
    """Whether the process has a cache folder of its own choosing."""
    chosen = os.environ.get(VARIABLE)
    return bool(chosen) and os.path.abspath(chosen or "") != default()


def keep_in(run_dir: Path) -> Path | None:
    """Point inductor's cache at ``run_dir``/compile-cache unless the user chose one; the folder used, or None."""
    if chosen_by_user():
        return None
    folder = run_dir / "compile-cache"
    os.environ[VARIABLE] = str(folder)
    return folder
