"""Where a sweep keeps its files, and its record ``sweep.json``, for the parts that write them (submitting, the
worker array's script, the workers inside their jobs) and the parts that read them (status, report, dashboard)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.core.files import write_json
from trainer.core.records import Typed

if TYPE_CHECKING:
    from cluster.sweeps.spec import SweepSpec

SWEEP_FILE = "sweep.json"


def log_path(sweep_dir: Path, worker: str) -> Path:
    """A worker's batch log (``worker``: ``<array>_<task>``, or ``%A_%a`` in the script's --output)."""
    return sweep_dir / "logs" / f"worker-{worker}.out"


@dataclass(frozen=True)
class SweepFile(Typed):
    """``<sweep>/sweep.json``: what a sweep was made from and what was submitted for it. Written at submit time (and
    by ``RESUME``), read by its workers inside their jobs and by the displays; it reads every earlier layout (an
    unknown key is kept)."""

    sweep_id: str = ""
    study: str | None = None
    """The Optuna study's name (sweeps of the first versions kept none: no table for them)."""
    target: int = 0
    """Trials the study should end with (what the workers run until)."""
    arrays: tuple[str, ...] = ()
    """The Slurm job arrays of its workers, in submission order (a RESUME adds one)."""
    spec_file: str = ""
    profile: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    """The spec it was made from (cluster/sweeps/spec.py), its database password hidden."""
    submitted_at: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, sweep_dir: Path) -> SweepFile:
        """The sweep's record (OSError, ValueError: not a sweep folder)."""
        data = json.loads((sweep_dir / SWEEP_FILE).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{sweep_dir / SWEEP_FILE} holds no record")
        return cls.from_json({**data, "arrays": tuple(str(a) for a in data.get("arrays") or [])})

    @property
    def settings(self) -> SweepSpec:
        """The spec it was made from, typed: a key an earlier layout lacks takes its default, one a newer version
        added is left out (a sweep of either stays readable)."""
        from cluster.sweeps.spec import SweepSpec

        known = {f.name for f in dataclasses.fields(SweepSpec)}
        return SweepSpec(**{k: v for k, v in self.spec.items() if k in known})

    def write(self, sweep_dir: Path) -> None:
        write_json(sweep_dir / SWEEP_FILE, {**self.to_json(), "arrays": list(self.arrays)})

    def but(self, **changes: Any) -> SweepFile:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
