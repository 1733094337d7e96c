"""A run's attempts and its goodput, read from its event log (``events.jsonl``).

Goodput is productive node-time over allocated node-time: allocated is each attempt's lifetime (from its batch
script's start when known, else its process's) × nodes; productive is its training time less checkpoint stalls and
less the steps the next attempt had to compute again (those after the last checkpoint it resumed from).
``gap_before_s``: time between attempts (queued, restarting).
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from trainer.core import exits
from trainer.core.env import DistEnv, JobInfo
from trainer.core.events import git_commit, read


def versions() -> dict[str, Any]:
    """What an attempt records of its software: Python, torch, CUDA, NCCL."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}


@dataclass
class Attempt:
    """One start of the job (a requeue or a restart begins the next)."""

    start: float
    info: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    batch_start: float | None = None
    """When the batch script started this attempt (its ``job_start`` event), if it did."""

    @property
    def opened(self) -> bool:
        """Its session opened (an ``attempt`` event); else a batch start only: a command, or a start that died."""
        return self.info.get("event") == "attempt"

    def times(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def end(self) -> float:
        """The exit event's time, or the last event's (an attempt killed without one; its own start event at least)."""
        return max([self.start, float(self.info.get("t", self.start)), *(e["t"] for e in self.events)])

    @property
    def exit_code(self) -> Any:
        """The loop's exit code, else the batch script's view of the tasks' (job_end), else "killed"."""
        exits = self.times("exit") or self.times("job_end")
        return exits[0]["code"] if exits else "killed"

    @property
    def verdict(self) -> dict[str, Any]:
        """The batch shell's verdict on this attempt (class, cause, blamed nodes, decision), when it gave one."""
        ends = self.times("attempt_end")
        return ends[-1] if ends else {}

    @property
    def first_step_t(self) -> float | None:
        first = self.times("first_step")
        return first[0]["t"] if first else None

    @property
    def last_step(self) -> int:
        steps = [e["step"] for e in self.events if isinstance(e.get("step"), int)]
        return max([int(self.info.get("resumed_step") or 0), *steps])

    @property
    def stall_s(self) -> float:
        return sum(float(e.get("stall_s", 0.0)) for e in self.times("checkpoint"))


def attempts(run_dir: Path) -> list[Attempt]:
    """The run's attempts in order, each with its events: the session's (``attempt``), or the batch script's
    (``job_start``/``job_end``) for a command that does not use it and for a start that died before its session
    opened (a bad node, an import error). An attempt starts when its batch script did, if known."""
    out: list[Attempt] = []
    batch: Attempt | None = None
    """The batch start whose session has not opened (yet): its ``attempt`` event, if one comes, completes it."""
    for e in read(run_dir):
        if e["event"] == "job_start":
            batch = Attempt(e["t"], {**e, "resumed_step": None}, batch_start=e["t"])
            out.append(batch)
        elif e["event"] == "attempt":
            started = float(e.get("started", e["t"]))
            if batch is None:  # no batch script (a local run), or a recovery in place inside the same batch
                out.append(Attempt(started, e))
            else:
                out[-1] = Attempt(min(started, batch.start), e, batch.events, batch_start=batch.start)
            batch = None
        elif out:
            out[-1].events.append(e)
    return out


def figures(runs: list[Attempt]) -> dict[str, Any]:
    """The report's table as numbers (see the module docstring for the arithmetic)."""
    rows, alloc, productive = [], 0.0, 0.0
    for i, a in enumerate(runs):
        nodes = int(a.info.get("nodes") or 1)
        allocated = a.end - a.start
        startup = (a.first_step_t - a.start) if a.first_step_t else allocated
        training = (a.end - a.first_step_t) if a.first_step_t else 0.0
        done = a.last_step - int(a.info.get("resumed_step") or 0)
        step_s = training / done if done > 0 else 0.0
        lost = max(0, a.last_step - _resumed_after(runs, i))
        useful = max(0.0, training - a.stall_s - lost * step_s)
        alloc += allocated * nodes
        productive += useful * nodes
        ended, cause, code = a.verdict.get("class"), a.verdict.get("cause"), a.exit_code
        if i + 1 < len(runs) and runs[i + 1].info.get("regroup"):  # a lost rank; the others went on: no exit
            ended, cause, code = "infrastructure", "a rank was lost: the others went on in place", None
        rows.append({"attempt": i + 1, "id": a.info.get("attempt"), "job_id": a.info.get("job_id"),
                     "restart": a.info.get("restart"),
                     "nodes": nodes, "processes": a.info.get("processes"), "resumed_step": a.info.get("resumed_step"),
                     "last_step": a.last_step, "exit": code, "allocated_s": allocated, "startup_s": startup,
                     "training_s": training, "stall_s": a.stall_s, "lost_steps": lost, "lost_s": lost * step_s,
                     "productive_s": useful, "gap_before_s": max(0.0, a.start - runs[i - 1].end) if i else 0.0,
                     "ended": ended, "cause": cause,
                     "blamed": ",".join(a.verdict.get("blamed") or []) or None})
    return {"attempts": rows, "allocated_node_s": alloc, "productive_node_s": productive,
            "recovery_s": recovery(rows), "recoveries": recoveries(runs), "cadence": cadence(runs, rows),
            "audits": audit_lines(runs), "startup": startup_lines([a for a in runs if a.opened][:1]),
            "goodput": productive / alloc if alloc > 0 else 0.0, "lost_steps": sum(r["lost_steps"] for r in rows),
            "stall_s": sum(r["stall_s"] for r in rows)}


def _resumed_after(runs: list[Attempt], i: int) -> int:
    """The step the next attempt that opened a session resumed from (starts that died before theirs resumed
    nothing); attempt ``i``'s own last step when none did (nothing of it was computed again)."""
    later = [int(b.info.get("resumed_step") or 0) for b in runs[i + 1:] if b.opened]
    return later[0] if later else runs[i].last_step


def recovery(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds spent recovering, by what ended the attempt: its recomputed steps, then the wait and start-up of the
    next attempt (``preempted`` vs ``failure``, the cluster's faults; other endings stop the job)."""
    out = {"preempted": 0.0, "failure": 0.0}
    for row, after in zip(rows, rows[1:], strict=False):
        kind = {"preempted": "preempted", "infrastructure": "failure"}.get(row["ended"] or "")
        if kind:
            out[kind] += row["lost_s"] + after["gap_before_s"] + after["startup_s"]
    return out


PHASES = ("detection", "teardown", "verdict", "queue", "startup", "restore", "first_step")
"""A recovery's parts, from the failed attempt's last step to the next attempt's first (see :func:`recoveries`)."""


def recoveries(runs: list[Attempt]) -> list[dict[str, Any]]:
    """Each recovery from a failure: seconds per phase, where the next attempt restored from, steps recomputed.

    detection: the failed attempt's last sign of progress → the first rank's end record (at most the true delay: a
    rank checks in every few steps); teardown: → srun returned; verdict: → its decision; queue: → the next attempt's
    batch start (a requeue's pending time; ~0 in the allocation); startup: → the restore began (interpreter, torch,
    process group, model); restore: the restore itself; first_step: → the first step of the next attempt done."""
    out: list[dict[str, Any]] = []
    # Between sessions: a start that died before its own (a bad node) is part of the wait for the next.
    for (number, a), (_, b) in pairwise([(i, r) for i, r in enumerate(runs, start=1) if r.opened]):
        if b.info.get("regroup"):
            out += in_place(number, a, b)
            continue
        if b.info.get("grew"):  # warm spares joined at a step boundary: no failure to recover from
            continue
        end = a.verdict
        if end.get("class") not in ("infrastructure", None) or a.exit_code in (0, 75) or not b.first_step_t:
            continue
        steps = [e["t"] for e in a.events if isinstance(e.get("step"), int) and e["event"] != "attempt_end"]
        last = max(steps, default=a.start)
        job_end = next((e["t"] for e in a.times("job_end")), None) or end.get("t") or a.end
        noticed = min(float(end.get("first_end_t") or job_end), job_end)
        decided = float(end.get("t") or job_end)
        begun = b.batch_start or b.start
        restore = float(b.info.get("restore_s") or 0.0)
        attempt_t = float(b.info.get("t", begun))
        marks = [last, noticed, job_end, decided, begun, attempt_t - restore, attempt_t, b.first_step_t]
        for i in range(1, len(marks)):  # clocks of several machines: each mark at or after the one before
            marks[i] = max(marks[i], marks[i - 1])
        times = {k: marks[i + 1] - marks[i] for i, k in enumerate(PHASES)}
        out.append({"after_attempt": number, "cause": end.get("cause"), "decision": end.get("decision"),
                    **times, "total_s": marks[-1] - marks[0],
                    "restored_from": b.info.get("restored_from"), "fetched_bytes": b.info.get("fetched_bytes", 0),
                    "recomputed_steps": max(0, a.last_step - int(b.info.get("resumed_step") or 0))})
    return out


IN_PLACE = ("detection", "abort", "rendezvous", "transfer", "first_step")
"""A recovery in place's parts (a regroup, ``Session.regroup``): the store saw the rank lost → the survivors knew
(detection), the failed group let go (abort), the next group made (rendezvous), the step agreed, the state sent to
any member behind and the group's parts made again (transfer), → the first step done (first_step)."""


def in_place(number: int, a: Attempt, b: Attempt) -> list[dict[str, Any]]:
    """Attempt ``b``, a recovery in place after attempt ``number`` (``a``), by phase (see :data:`IN_PLACE`)."""
    said = b.times("regroup")
    if not said or not b.first_step_t:
        return []
    r = said[0]
    times = {k: float(r.get(f"{k}_s") or 0.0) for k in IN_PLACE[:-1]}
    times["first_step"] = max(0.0, b.first_step_t - float(b.info["t"]))
    how = ("a warm spare took the place" if r["world_size"] >= r["was"] else
           f"{r['world_size']} of {r['was']} processes went on")
    return [{"after_attempt": number, "cause": f"{exits.names(r['lost'])} lost, {how}",
             "decision": "in place", **times, "total_s": sum(times.values()), "restored_from": None,
             "fetched_bytes": 0, "recomputed_steps": max(0, a.last_step - int(b.info.get("resumed_step") or 0))}]


SLOW_IMPORTS_S = 5.0
"""Imports past this, and most of a start-up, get a pointer to the doctor's bytecode row."""


def startup_lines(runs: list[Attempt]) -> list[str]:
    """One line per attempt given: its start to its first step, by phase (the attempt event's ``startup``)."""
    out = []
    for i, a in enumerate(runs, start=1):
        phases = a.info.get("startup")
        if not phases or not a.first_step_t:
            continue
        first = max(0.0, a.first_step_t - float(a.info["t"]))
        total = sum(phases.values()) + first
        why = (" (mostly imports: `python -m trainer.doctor` says whether torch compiles its sources at every start)"
               if phases["imports_s"] >= max(SLOW_IMPORTS_S, total / 2) else "")
        out.append(f"start-up of attempt {i}: {total:.1f} s to the first step (imports {phases['imports_s']:.1f}, "
                   f"process group {phases['group_s']:.1f}, model and data {phases['model_s']:.1f}, restore "
                   f"{phases['restore_s']:.1f}, first step {first:.1f}){why}")
    return out


def describe_recovery(r: dict[str, Any]) -> str:
    """One line: a recovery's time to the next first step, by phase, and what it restored and recomputed."""
    if r["decision"] == "in place":
        parts = ", ".join(f"{k.replace('_', ' ')} {1000 * r[k]:.0f} ms" for k in IN_PLACE)
        return (f"recovered in place after attempt {r['after_attempt']} ({r['cause']}; no process started, no file "
                f"read): {1000 * r['total_s']:.0f} ms from the loss to the next first step ({parts}); "
                f"{r['recomputed_steps']} step(s) recomputed")
    parts = ", ".join(f"{k.replace('_', ' ')} {r[k]:.1f}" + (f" from {r['restored_from']}" if k == "restore" and
                                                             r["restored_from"] else "") for k in PHASES)
    return (f"recovery after attempt {r['after_attempt']} ({r['decision']}): {r['total_s']:.1f} s from its last step to "
            f"the next first step ({parts}); {r['recomputed_steps']} step(s) recomputed")


def audit_lines(runs: list[Attempt]) -> list[str]:
    """One line per straggler named, per replica disagreement (audit.*) and per growing back, with its attempt."""
    out = []
    for i, a in enumerate(runs, start=1):
        for e in a.times("regroup"):
            if not e["lost"]:
                out.append(f"grew back in attempt {i}: warm spares joined, {e['was']} → {e['world_size']} processes "
                           f"from step {e['step']} in {1000 * e['total_s']:.0f} ms (no rank lost)")
        for e in a.times("straggler"):
            times = ", ".join(f"{n} {ms:g} ms" + (" (slow)" if n == e["node"] else "") for n, ms in e["ms"].items())
            then = "saved and restarted without it" if e["action"] == "restart" else "reported"
            who = f"rank {e['rank']} on {e['node']}" if e.get("blame", True) else f"rank {e['rank']} (one node)"
            lost = f", {e['lost_s']:.1f} s ({e['lost_pct']:.0f} %) lost waiting for it" if "lost_s" in e else ""
            out.append(f"straggler in attempt {i}: {who} took {e['ratio']:.2f}× the others' time per step from step "
                       f"{e['since']} (named at step {e['step']}; {times}{lost}); {then}")
        for e in a.times("corruption"):
            who = ", ".join(e.get("nodes") or []) or "no node (no majority)"
            what = e.get("cause") or f"ranks {e.get('ranks')} disagreed with the other replicas at step {e.get('step')}"
            out.append(f"silent corruption in attempt {i}: {what}; not saved, restarted from the last checkpoint, "
                       f"blaming {who}")
    return out


def cadence(runs: list[Attempt], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The auto cadence's last interval, the work it expects an unannounced interruption to lose (half an interval)
    and what such interruptions lost here (attempts that ended without a save or a finish); None without it."""
    said = [e for a in runs for e in a.times("cadence")]
    if not said:
        return None
    cut = [r["lost_s"] for a, r in zip(runs[:-1], rows[:-1], strict=True) if a.opened and r["exit"] not in (0, 75)]
    return {"interval_s": said[-1]["interval_s"], "expected_lost_s": said[-1]["interval_s"] / 2,
            "measured_lost_s": sum(cut) / len(cut) if cut else None, "interruptions": len(cut)}


def summary(f: dict[str, Any]) -> dict[str, float]:
    """The figures a tracker's run summary keeps (goodput and what it is made of, recoveries by phase)."""
    phases = {f"recovery/{k}_s": sum(r.get(k, 0.0) for r in f["recoveries"]) for k in (*PHASES, *IN_PLACE)
              if any(k in r for r in f["recoveries"])}
    return {"goodput": f["goodput"], "productive_node_s": f["productive_node_s"],
            "allocated_node_s": f["allocated_node_s"], "lost_steps": f["lost_steps"], "checkpoint_stall_s": f["stall_s"],
            "recoveries": len(f["recoveries"]), **phases}


def started(env: DistEnv, job: JobInfo, started_at: float, resumed_step: int, marks: tuple[float, float],
            **more: Any) -> dict[str, Any]:
    """The facts an ``attempt`` event records: when and where this start of the job runs, what it continues, and
    its start-up so far by phase (``marks``: when the session opened and when its process group was up)."""
    return dict(started=round(started_at, 3), job_id=env.job_id, restart=job.restart_count, attempt=exits.attempt_id(),
                array_job_id=job.array_job_id, array_task_id=job.array_task_id, nodes=env.num_nodes,
                processes=env.world_size, resumed_step=resumed_step, **more,
                startup=phases(started_at, *marks, time.time(), float(more.get("restore_s") or 0.0)),
                git=git_commit(Path.cwd()), **versions())


def phases(started_at: float, opened: float, grouped: float, now: float, restore_s: float) -> dict[str, float]:
    """Seconds from the process's start (whole seconds of the kernel's boot time: ±1 s) to the session opening
    (interpreter, imports, the user's code before it), the process group, model and data, and the restore."""
    return {"imports_s": round(max(0.0, opened - started_at), 3), "group_s": round(grouped - opened, 3),
            "model_s": round(max(0.0, now - restore_s - grouped), 3), "restore_s": round(restore_s, 3)}
