"""A session's parts, built in one place: each owns its state behind a small interface, and the session only calls
them. ``open_parts`` builds them from the config once ``restore`` knows the objects; ``open_group`` the ones that
hold the process group (the audits, and the save policy with its poll), which a new group would build again.

Everything that can refuse the run (an audit that cannot run here, a checkpoint of another layout, snapshots the
nodes cannot hold) is decided before the first byte is written: bad input leaves no run folder behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import open_checkpointer
from trainer.core import exits, hooks
from trainer.core.env import DistEnv, JobInfo
from trainer.core.events import EventLog, read
from trainer.core.regroup import Grow, Membership
from trainer.core.schema import Config
from trainer.runtime import compile_cache
from trainer.runtime.growth import Growth
from trainer.runtime.health.audit import Audit
from trainer.runtime.health.heartbeat import Heartbeat, hang_folder
from trainer.runtime.records.rundir import RunDir
from trainer.runtime.records.tracking import Tracker
from trainer.runtime.records.trial import Reports
from trainer.runtime.saving.policy import SavePolicy, save_policy
from trainer.runtime.saving.restore import Resumption, resume
from trainer.runtime.saving.saves import Saves
from trainer.runtime.saving.signals import Preemption
from trainer.runtime.saving.snapshots import Snapshots


@dataclass(frozen=True)
class Setup:
    """What a session knows before its run folder opens."""

    cfg: Config
    env: DistEnv
    job: JobInfo
    device: torch.device
    preemption: Preemption
    sharded: bool
    """Checkpoints in the sharded format (every rank writes its part)."""
    say: Callable[[str], None]
    """Print on rank 0."""
    membership: Membership | None = None
    """This rank's share of a job whose store runs apart (it can regroup and grow back), else None."""


@dataclass(frozen=True)
class Reloaded:
    """What a sharded model's regroup loaded: the new group's snapshots (opened to load from) and the restore."""

    snapshots: Snapshots | None
    resumption: Resumption


@dataclass(frozen=True)
class Group:
    """The parts that hold the process group: the audits and the save policy, whose poll agrees across the ranks."""

    audit: Audit
    policy: SavePolicy
    growth: Growth | None = None
    """Whether to grow back at this step (a group that can regroup: a sharded one with memory snapshots)."""

    def grow_if_due(self, step: int, busy: bool) -> None:
        """After the poll at ``step``: ``Grow`` when the ranks agreed to grow back, unless they save or stop now
        (``busy``)."""
        if self.growth and self.growth.due and not busy:
            raise Grow(f"warm spares wait at step {step}: the group grows back (Session.regroup)")


@dataclass(frozen=True)
class Parts:
    """A run's parts, once its folder is open."""

    run: RunDir
    events: EventLog
    """Rank 0's event log (events.jsonl; the other ranks' writes nothing)."""
    heartbeat: Heartbeat
    reports: Reports
    snapshots: Snapshots | None
    restored: Resumption
    """What the run continued from (nothing on a fresh start), and how the restore went."""
    tracker: Tracker
    group: Group
    saves: Saves
    failures: int = 0
    """The job's infrastructure failures before this attempt (``max_failures`` counts them; read where it applies)."""


def open_parts(s: Setup, model: nn.Module | None, objects: dict[str, Any], config: dict[str, Any],
               config_yaml: str, wrapper: nn.Module | None = None) -> Parts:
    """Collective: decide and check everything, restore ``objects``, then open the run folder and its parts
    (``config``: what W&B records, ``config_yaml``: the run folder's config.yaml; ``wrapper``: DDP around ``model``)."""
    cfg, env, job = s.cfg, s.env, s.job
    Audit.check(cfg, env, model, s.device)
    run = RunDir.decide(env, cfg.run.dir or job.run_dir)
    events = EventLog(run.path if env.is_main else None)  # opens its file at the first event
    snapshots = Snapshots.open(cfg, env, job, run.path, s.sharded, model, events.emit)
    restored = resume(cfg, env, run.path, snapshots, objects, model, s.say)
    if snapshots:
        snapshots.check_room(objects, explicit=cfg.checkpoint.memory == "on")
    run.create(config_yaml)  # the first write of this attempt
    heartbeat = _heartbeat(s, run)
    tracker = Tracker(cfg, env, job, run.path)
    tracker.start(config, restored.run_id)
    group = open_group(s, run, model, objects, restored.step, events, snapshots, wrapper)
    saves = _saves(s, run, group, heartbeat, events, restored, model)
    return Parts(run, events, heartbeat, Reports(run.path, env, job.pruning), snapshots, restored, tracker, group, saves,
                 failures_before(s, run.path))


def failures_before(s: Setup, run_dir: Path) -> int:
    """The job's infrastructure failures before this attempt, from its event log, where a limit applies to a regroup."""
    if s.job.store is None or s.job.max_failures is None:
        return 0
    return exits.failures(list(read(run_dir)), str(s.env.job_id), besides=exits.attempt_id())


def _saves(s: Setup, run: RunDir, group: Group, heartbeat: Heartbeat, events: EventLog, restored: Resumption,
           model: nn.Module | None) -> Saves:
    checkpointer = open_checkpointer(s.sharded, run.checkpoints, s.env.is_main, s.cfg.checkpoint.keep,
                                     on_write=heartbeat.alive, model=model)
    return Saves(checkpointer, group.policy, heartbeat, events, s.env.is_main, restored.resumed)


def regrouped_parts(p: Parts, s: Setup, model: nn.Module | None, objects: dict[str, Any], step: int,
                    config: dict[str, Any], wrapper: nn.Module | None = None, reloaded: Reloaded | None = None) -> Parts:
    """Collective, after a regroup (``s.env``: this rank's new place): the parts that hold the group, or that only
    rank 0 has, made again from ``step`` on. The run folder, the restore and the hang watchdog stay; a rank that
    becomes rank 0 opens the event log and the tracker (the run's W&B id is in its folder). ``reloaded``: the
    snapshots a sharded model's regroup opened already."""
    env = s.env
    p.group.audit.close()
    settle_saves(p, s.say)
    run, events, tracker = RunDir(p.run.path, env), p.events, p.tracker
    p.heartbeat.env, p.heartbeat.folder = env, _group_hang(run, s)  # its files go by the rank now
    if env.is_main and not p.run.env.is_main:
        events, tracker = EventLog(run.path), Tracker(s.cfg, env, s.job, run.path)
        tracker.start(config, p.restored.run_id)
    tracker.moved(env)
    snapshots = p.snapshots
    if reloaded:
        snapshots = _emitting(reloaded.snapshots, events)
    elif snapshots:
        snapshots.close(finished=False)
        snapshots = Snapshots.open(s.cfg, env, s.job, run.path, s.sharded, model, events.emit)
    group = open_group(s, run, model, objects, step, events, snapshots, wrapper)
    saves = _saves(s, run, group, p.heartbeat, events, p.restored, model)
    saves.saved_step, saves.last_path, saves.stall_s = p.saves.saved_step, p.saves.last_path, p.saves.stall_s
    return dataclasses.replace(p, run=run, events=events, reports=Reports(run.path, env, s.job.pruning),
                               snapshots=snapshots, tracker=tracker, group=group, saves=saves)


def settle_saves(p: Parts, say: Callable[[str], None]) -> None:
    """A background save of the old group: finished, or failed with it (the newest complete one stands; one note)."""
    try:
        p.saves.checkpointer.wait()
    except (RuntimeError, OSError) as exc:
        say(f"note: a background save did not finish before the regroup: {exc}")


def open_group(s: Setup, run: RunDir, model: nn.Module | None, objects: dict[str, Any], step: int, events: EventLog,
               snapshots: Snapshots | None, wrapper: nn.Module | None = None) -> Group:
    """Collective: the audits from ``step`` on, and the save policy whose poll also agrees the snapshots' interval
    and the straggler meter's times."""
    audit = Audit(s.cfg, s.env, model, objects, s.device, step, events.emit, s.say, wrapper)
    sharded = s.cfg.dist.sharded  # a sharded group grows back through a snapshot of the step it grows at
    growth = Growth(s.membership) if s.membership and (snapshots or not sharded) else None
    policy = save_policy(s.cfg.checkpoint, s.env, s.preemption, run.path, s.job.mtbf_hours, hooks.current().end_in_s,
                         s.job.end_time, parts=(snapshots, audit.meter, growth))
    return Group(audit, policy, growth)


def joined_parts(s: Setup, run_dir: Path, model: nn.Module | None, objects: dict[str, Any], step: int,
                 wrapper: nn.Module | None = None, reloaded: Reloaded | None = None) -> Parts:
    """Collective, on a warm spare that took a lost rank's place (``run_dir``: the survivors' run folder): its parts
    from ``step`` on, made as the survivors make theirs again (``regrouped_parts``; ``reloaded`` as there)."""
    env, cfg = s.env, s.cfg
    compile_cache.keep_in(run_dir)  # before its first forward: what the others compiled, not compiled again
    run, events = RunDir(run_dir, env), EventLog(run_dir if env.is_main else None)
    heartbeat = _heartbeat(s, run)
    tracker = Tracker(cfg, env, s.job, run.path)
    snapshots = (_emitting(reloaded.snapshots, events) if reloaded else
                 Snapshots.open(cfg, env, s.job, run.path, s.sharded, model, events.emit))
    group = open_group(s, run, model, objects, step, events, snapshots, wrapper)
    restored = Resumption(step=step)
    saves = _saves(s, run, group, heartbeat, events, restored, model)
    return Parts(run, events, heartbeat, Reports(run.path, env, s.job.pruning), snapshots, restored, tracker, group, saves,
                 failures_before(s, run.path))


def _emitting(snapshots: Snapshots | None, events: EventLog) -> Snapshots | None:
    """Snapshots opened before the group's event log was: they report to it now."""
    if snapshots is not None:
        snapshots.emit = events.emit
    return snapshots


def _heartbeat(s: Setup, run: RunDir) -> Heartbeat:
    """This rank's hang watchdog; where the group can go on without a stuck rank, it has the store kill it (and
    counts there while it runs: a stopped rank is found without waiting for its files)."""
    return Heartbeat(s.env, _group_hang(run, s), s.cfg.dist.heartbeat_s, store=s.membership)


def _group_hang(run: RunDir, s: Setup) -> Path:
    """Where a hang report of this group goes (``hang_folder``: its generation's)."""
    return hang_folder(run.path, s.membership.place.generation if s.membership else 0)


def finished(p: Parts, summary: dict[str, Any], step: int, report: bool) -> None:
    """A finished run's end: result.json, the exit event, the report (``report``: its page too), W&B's summary."""
    p.run.write_result(summary)
    p.events.emit("exit", durable=True, code=0, step=step)
    goodput = p.run.write_report(report)
    p.tracker.finish({k.replace("test_", "test/", 1): v for k, v in summary.items() if k.startswith("test_")}
                     | {"global_step": step} | goodput)


def close_parts(p: Parts, exit_code: int) -> None:
    """Stop the watchdog and the audits, keep a failed attempt's snapshots for its restart, wait for a background
    save, close W&B (``exit_code``: the process's)."""
    p.heartbeat.stop()
    p.group.audit.close()
    if p.snapshots is not None:
        p.snapshots.close(finished=False)
    try:
        p.saves.checkpointer.wait()
    finally:
        p.tracker.finish(exit_code=exit_code)
