"""What the processes of a job tell each other through the run folder, as typed records: each rank's exit record,
the requeue marker, and the verdict on each attempt (``attempt_end``). Each has a schema version and reads every
earlier layout (missing keys take their defaults; a newer version's unknown keys are kept in ``extra``), so a job
queued across an upgrade still reads what its earlier attempts wrote. Stdlib only: the verdict runs with the host's
python3, beside any container.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

_R = TypeVar("_R", bound="Typed")


class Typed:
    """A frozen record that reads any earlier layout of its JSON and writes its fields back under the same keys."""

    schema = 1
    keys: dict[str, str] = {}
    """JSON key → field name, where they differ (``class`` is a keyword)."""

    @classmethod
    def from_json(cls: type[_R], data: dict[str, Any]) -> _R:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        known, extra = {}, {}
        for key, value in data.items():
            name = cls.keys.get(key, key)
            if name in names and name != "extra":
                known[name] = value
            elif key != "schema":
                extra[key] = value
        return cls(**known, extra=extra)  # type: ignore[call-arg]

    def to_json(self) -> dict[str, Any]:
        back = {name: key for key, name in self.keys.items()}
        out: dict[str, Any] = {"schema": self.schema}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name != "extra":
                out[back.get(f.name, f.name)] = getattr(self, f.name)
        return {**out, **getattr(self, "extra", {})}


@dataclass(frozen=True)
class ExitRecord(Typed):
    """How one process of an attempt ended (``exits/<job>.<attempt>/<phase>-<rank>.json``), written as it starts
    (``code`` None: a process that never writes its end was killed) and again as it ends."""

    keys = {"class": "kind"}

    rank: int = 0
    node: str = "?"
    """Slurm's name for the node (a container's host name is no node's name)."""
    pid: int = 0
    t: float = 0.0
    """When it was written (wall clock)."""
    phase: str = "train"
    """train, or doctor (the preflight step)."""
    code: int | None = None
    """The exit code (None: still running, or killed before it could say)."""
    kind: str | None = None
    """finished, preempted, user_error, resource or infrastructure (trainer/core/exits.py)."""
    cause: str | None = None
    """The first cause in one line."""
    where: str | None = None
    """file:line of a user error."""
    echo: bool = False
    """It ended because another rank did (a collective lost its peer): never a first cause."""
    hard: bool = False
    """Hard evidence against the node (a device error)."""
    blame: list[str] | None = None
    """The nodes it blames (a hang report names the stuck ranks'); None: its own node, if infrastructure."""
    aborted: bool = False
    """The command crashed with SIGABRT (a teardown without a barrier, when every rank had finished)."""
    step: int | None = None
    went_on_without: list[int] | None = None
    """The ranks (as started) this process went on without, in place (``Session.regroup``): their ends are no
    failure of the attempt's."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.code is not None

    @property
    def is_cause(self) -> bool:
        """A failure of its own: ended, neither finished nor saved (75), and no echo."""
        return self.code not in (None, 0, 75) and not self.echo

    def describe(self) -> str:
        """One line: who ended how (``rank 3 on n2: ValueError: … (model.py:30)``)."""
        where = f" ({self.where})" if self.where else ""
        return f"rank {self.rank} on {self.node}: {self.cause}{where}"


def exit_records(folder: Path) -> list[ExitRecord]:
    """Every readable record in an attempt's folder."""
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append(ExitRecord.from_json(data))
    return out


REQUEUE_MARKER = "requeue.json"
"""Left in the run folder by rank 0 after a save for a requeue, for launchers that cannot see exit code 75."""


@dataclass(frozen=True)
class RequeueMarker(Typed):
    """``$RUN_DIR/requeue.json``: this attempt saved (or was stopped) to be requeued, and why."""

    keys = {"signal": "reason"}

    reason: str = ""
    """The signal's name (``SIGUSR2``), ``deadline`` (saved before the job's time limit), or what a command's wrapper
    did (``stopped after the warning signal``, ``the command exited 75``)."""
    step: int | None = None
    checkpoint: str | None = None
    by: str | None = None
    """``trainer.launch``: a command's wrapper left it, not the session."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def deadline(self) -> bool:
        """Saved for the job's time limit, not for a preemption: a requeue that max_requeues does not count."""
        return self.reason == "deadline"

    @classmethod
    def read(cls, run_dir: Path) -> RequeueMarker | None:
        """The marker in ``run_dir`` (None: none, or unreadable: an attempt's marker is written atomically)."""
        try:
            data = json.loads((run_dir / REQUEUE_MARKER).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        if "reason" in data and "signal" not in data:  # a wrapper's marker of an earlier layout: its words, no signal
            data = {**data, "signal": data.pop("reason")}
        return cls.from_json(data)

    def write(self, run_dir: Path) -> None:
        """Atomically (a reader never sees half of it)."""
        tmp = run_dir / f".{REQUEUE_MARKER}.{os.getpid()}"
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, run_dir / REQUEUE_MARKER)


@dataclass(frozen=True)
class AttemptEnd(Typed):
    """The verdict on one attempt, an ``attempt_end`` line of events.jsonl (cluster/job/verdict.py writes it; the
    budgets, the report and the run tools read it)."""

    keys = {"class": "kind"}

    job_id: str = ""
    attempt: str = "0"
    phase: str = "train"
    kind: str = ""
    """The attempt's class (finished, preempted, user_error, resource, infrastructure)."""
    cause: str = ""
    where: str | None = None
    blamed: list[str] = field(default_factory=list)
    hard: bool = False
    step: int | None = None
    start_step: int | None = None
    progressed: bool | None = None
    first_end_t: float | None = None
    deadline: bool = False
    """A save before the job's time limit (a requeue max_requeues does not count)."""
    decision: str = ""
    """requeue, restart_here, fail or done."""
    why: str = ""
    t: float = 0.0
    event: str = "attempt_end"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptEnd:
        if "deadline" not in data and str(data.get("cause", "")).startswith("deadline: "):  # before the flag existed
            data = {**data, "deadline": True}
        return super().from_json(data)


def attempt_ends(events: list[dict[str, Any]], job: str) -> list[AttemptEnd]:
    """The verdicts on a job's attempts, from its run's events (a reused run folder holds other jobs' too)."""
    return [AttemptEnd.from_json(e) for e in events if e.get("event") == "attempt_end" and str(e.get("job_id")) == job]
