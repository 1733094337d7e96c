"""Loaded through PYTHONPATH by tests: records every file-writing call of this process.

With AUDIT_LOG set, each write-open, mkdir, rename/replace and remove is appended to
``$AUDIT_LOG.<RANK>`` as ``event<TAB>path`` lines, using raw descriptors so that logging
does not audit itself.
"""

import os
import sys

_log = os.environ.get("AUDIT_LOG")
if _log:
    _fd = os.open(f"{_log}.{os.environ.get('RANK', 'single')}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _hook(event: str, args: tuple) -> None:  # type: ignore[type-arg]
        path = None
        if event == "open":
            target, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
            path = target if writes else None
        elif event in ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree"):
            path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            os.write(_fd, f"{event}\t{os.path.abspath(os.fsdecode(path))}\n".encode())

    sys.addaudithook(_hook)
