"""Where a sweep keeps its files, for the parts that write them (the worker array's script, the workers inside
their jobs) and the parts that read them (status, logs)."""

from __future__ import annotations

from pathlib import Path


def log_path(sweep_dir: Path, worker: str) -> Path:
    """A worker's batch log (``worker``: ``<array>_<task>``, or ``%A_%a`` in the script's --output)."""
    return sweep_dir / "logs" / f"worker-{worker}.out"
