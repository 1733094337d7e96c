"""A sweep's trials as the status table and the sweep page show them, and how their values are spelled."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.sweeps.spec import fmt


@dataclass
class Row:
    """One trial of the study as :func:`cluster.sweeps.status.status` sees it."""

    index: int
    """The trial's number in the study."""
    overrides: dict[str, Any]
    """The trial's values of the swept parameters."""
    state: str
    """complete, pruned, failed, running, requeued (running, its worker waiting in Slurm's queue) or waiting (planned)."""
    slurm: str
    """Slurm's state of the trial's worker (array task) in lower case, or unknown."""
    value: float | None
    """The metric the study was told; for a pruned trial its last intermediate value; None otherwise."""
    run_dir: Path
    """The trial's run folder."""
    steps: int = 0
    """Intermediate values the study holds (one per reported step)."""
    worker: str = ""
    """The array task that ran it (``<array>_<task>``)."""


def show(value: Any) -> str:
    """A value as a table shows it: floats to 4 significant digits (the trial ran with the full value)."""
    return f"{value:.4g}" if isinstance(value, float) else fmt(value)


def columns(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])
