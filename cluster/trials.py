"""A sweep's trials as the status table and the sweep page show them, and how their values are spelled."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """One trial as :func:`status` sees it."""

    index: int
    """Trial index."""
    overrides: dict[str, Any]
    """The trial's swept values."""
    state: str
    """done (result.json), requeued (requeue.json), else Slurm's state in lower case, or unknown."""
    slurm: str
    """Slurm's own state in lower case, or unknown when neither sacct nor squeue knows the task."""
    value: float | None
    """The metric from result.json; None until the trial is done."""
    run_dir: Path
    """The trial's run folder."""


def fmt(value: Any) -> str:
    """A value as the table shows it (YAML's spelling of scalars)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def columns(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])
