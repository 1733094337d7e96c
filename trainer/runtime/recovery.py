"""What survivors need to go on in place after a lost rank, without a file read: where each step started, which
step the optimizer last finished, and the agreement on the newest step every member holds.

Each step's start is marked on every rank (the loaders' positions and the random generators: a few integers and
one generator state, no model copy). An optimizer step post-hook tells a finished step from an interrupted one: a
rank that failed before its optimizer step holds the step before, one that failed after it (in the save poll, a
collective of its own) holds the step. The new group takes the newest step any member holds; a member behind it,
or a spare with nothing, gets the model, the optimizer and the rest from the first member that holds it (DDP's
replicas are equal, so any one of them will do). The loaders go on from that step's end on the new world size, as
a resume from a checkpoint at that step would; each rank keeps its own random stream.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from trainer.checkpoint.resume import continuing
from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.checkpoint.state import PerRank, load_into, state_of
from trainer.core import dist as tdist
from trainer.core import exits
from trainer.core.env import DistEnv, JobInfo
from trainer.core.errors import exit_now
from trainer.core.exits import SPARE_BASE
from trainer.core.regroup import Membership, Place, RegroupFailed, SpareReleased
from trainer.core.schema import Config
from trainer.data.loader import Loader, reshard
from trainer.runtime import ddp_group
from trainer.runtime.buckets import prime_when_resumed
from trainer.runtime.parts import Parts, Reloaded, Setup, joined_parts, regrouped_parts, settle_saves
from trainer.runtime.saving.restore import resume
from trainer.runtime.saving.snapshots import Snapshots


def join(env: DistEnv, cfg: Config, device: torch.device, job: JobInfo) -> tuple[int, Membership | None, DistEnv]:
    """Join the job's process group (``tdist.setup``); a warm spare (``job.spare``) waits here until a lost rank's
    place is its own. Returns (this process's rank as started, its membership where the store runs apart, its env)."""
    spare = None if job.spare is None else job.spare + env.rank  # a spare step's task: its own number
    origin = env.rank if spare is None else SPARE_BASE + spare
    if spare is None:  # a warm spare records its start once it has a place (a waiting one is no lost rank)
        exits.started(origin)  # a rank that never records its end was killed (the verdict reads these)
    try:
        membership = tdist.setup(env, cfg, device, job.store, spare)
    except SpareReleased as released:  # the attempt ended without needing this spare: nothing to record
        print(f"{exits.node_name()}: {released}", flush=True)
        exit_now(0)  # no exit record either: a spare that never trained is no rank of the attempt
    if membership and job.spare is not None:
        env = tdist.placed(env, membership)
        exits.started(origin)
    return origin, membership, env


class Marks:
    """Where this rank's current step started, and the last step its optimizer finished."""

    def __init__(self, objects: dict[str, Any], step: int) -> None:
        self.objects = objects
        self.loaders = {n: o for n, o in objects.items() if isinstance(o, Loader)}
        self.done = self.current = step
        self.stop = step
        """The loop's last step (``Session.steps``'s ``stop``): no group grows back there."""
        self.start: tuple[dict[str, dict[str, int]], dict[str, Any]] | None = None
        self.hooks = [o.register_step_post_hook(lambda *_: self._stepped())
                      for o in objects.values() if isinstance(o, torch.optim.Optimizer)]

    def _stepped(self) -> None:
        self.done = self.current

    def begin(self, step: int, stop: int) -> None:
        """Step ``step`` of a loop to ``stop`` starts now: the loaders' positions and the random state as it begins."""
        self.current, self.stop = step, stop
        self.start = ({n: o.state_dict() for n, o in self.loaders.items()}, rng_state())

    def resume_point(self) -> tuple[dict[str, dict[str, int]], dict[str, Any] | None]:
        """(the loaders' positions, the random state) at the end of step ``done``: the mark of the step after it,
        or now when that step's optimizer step was this rank's last act (nothing read since)."""
        if self.done == self.current or self.start is None:
            return {n: o.state_dict() for n, o in self.loaders.items()}, None
        return self.start

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def agree(marks: Marks, env: DistEnv, run_dir: str = "") -> tuple[int, bool, str, int]:
    """Collective in the new group: the newest step a member holds, whether every member held it (else the ones
    behind, a spare among them, got the state from the first that did: exact, but their random streams ran on a step
    further or start from the seed), the run folder (``run_dir``: this member's, empty for a spare), and the number
    of nodes the group is on."""
    said = tdist.gather((marks.done, exits.node_name()))
    held, hosts = [d for d, _ in said], {h for _, h in said}
    newest = max(held)
    source = held.index(newest)
    positions, rng = marks.resume_point()
    box: list[Any] = [positions, run_dir]
    behind = any(h != newest for h in held)
    if behind:
        box.append({n: state_of(o) for n, o in marks.objects.items()
                    if not isinstance(o, (Loader, PerRank)) and env.rank == source})
    if env.world_size > 1:
        dist.broadcast_object_list(box, src=source)
    if behind and env.rank != source:
        for name, state in box[2].items():
            load_into(marks.objects[name], state)
    for name, loader in marks.loaders.items():
        loader.reshape(env, box[0][name])
    if rng is not None and marks.done == newest:
        set_rng_state(rng)
    marks.done = marks.current = newest
    return newest, not behind, box[1], len(hosts)


def take_over(s: Setup, model: nn.Module | None, objects: dict[str, Any],
              wrapper: nn.Module | None) -> tuple[int, Parts, Marks]:
    """Collective, on a warm spare that took a lost rank's place (``s.env``: that place, never rank 0): the survivors'
    step, state, loader positions and run folder (their side is ``recover``), and this process's parts. Returns (the
    step to go on from, the parts, the marks)."""
    marks = Marks(objects, -1)
    if s.cfg.dist.sharded:  # the survivors' side is ``rejoin_sharded``
        s, folder, reloaded = reload(s, "", model, objects, marks)
        step = reloaded.resumption.step
        return step, joined_parts(s, folder, model, objects, step, wrapper, reloaded), marks
    step, _, run_dir, nodes = agree(marks, s.env)
    s = dataclasses.replace(s, env=dataclasses.replace(s.env, num_nodes=nodes))
    return step, joined_parts(s, Path(run_dir), model, objects, step, wrapper), marks


def meet(env: DistEnv, run_dir: str) -> tuple[str, int]:
    """Collective in a new group: the run folder (``run_dir``: this member's, empty for a spare) and the number of
    nodes the group is on."""
    said = tdist.gather((exits.node_name(), run_dir))
    return next(r for _, r in said if r), len({h for h, _ in said})


def reload(s: Setup, run_dir: str, model: nn.Module | None, objects: dict[str, Any],
           marks: Marks) -> tuple[Setup, Path, Reloaded]:
    """Collective, once a sharded model is sharded on the new group (``s.env``; ``run_dir`` as ``meet``'s): the newest
    snapshot its nodes hold together (else the newest checkpoint) loaded into ``objects``, ``marks`` at its step.
    Returns ``s`` with the group's number of nodes, the run folder and what was loaded; RuntimeError when there is
    none yet."""
    run, nodes = meet(s.env, run_dir)
    s = dataclasses.replace(s, env=dataclasses.replace(s.env, num_nodes=nodes))
    for loader in (o for o in objects.values() if isinstance(o, Loader)):  # the new split; the position comes next
        loader.reshape(s.env, loader.state_dict())
    snapshots = Snapshots.open(s.cfg, s.env, s.job, Path(run), s.sharded, model, lambda *_, **__: None)
    restored = resume(continuing(s.cfg), s.env, Path(run), snapshots, objects, model, s.say)  # never sets aside
    if restored.resumed is None:
        raise RuntimeError("no snapshot in node memory and no checkpoint holds the lost rank's shard yet")
    marks.done = marks.current = restored.step
    return s, Path(run), Reloaded(snapshots, restored)


def let_go(exc: BaseException) -> None:
    """Free what a failed collective's frames hold (its process group among it) and drop their tracebacks."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if cause.__traceback__ is not None:
            traceback.clear_frames(cause.__traceback__)
            cause.__traceback__ = None
        cause = cause.__context__ or cause.__cause__


def rejoin(exc: BaseException, membership: Membership, env: DistEnv, model: nn.Module | None,
           wrapper: nn.Module | None, marks: Marks, loaders: list[Loader | DataLoader[Any]],
           run_dir: str) -> tuple[DistEnv, int, bool, dict[str, float]]:
    """Collective among the survivors of ``exc`` (a failed collective): the failed group let go, the next one made,
    DDP moved onto it, the step agreed and every loader re-split. Returns (this rank's new place, the step to go on
    from, whether every member held it, seconds to let the failed group go (``abort_s``) and to form the next
    (``rendezvous_s``))."""
    began = time.monotonic()
    let_go(exc)  # the failed group's last holders: its sockets close, so a survivor waiting on this rank fails too
    if isinstance(wrapper, DDP):
        ddp_group.detach(wrapper)
    membership.leave()
    left = time.monotonic()
    env = tdist.regroup(membership, env)
    joined = time.monotonic()
    if isinstance(wrapper, DDP):
        ddp_group.remake(wrapper)
        if env.world_size > 2:  # the buckets a resume at this size sums in (runtime/buckets.py)
            prime_when_resumed(wrapper, lambda: True)
    if model is not None:  # the interrupted step's partial gradients: it runs again
        model.zero_grad(set_to_none=True)
    step, exact, _, nodes = agree(marks, env, run_dir)
    env = dataclasses.replace(env, num_nodes=nodes)
    for loader in loaders:
        if not isinstance(loader, Loader):
            reshard(loader, env)
    return env, step, exact, {"abort_s": round(left - began, 3), "rendezvous_s": round(joined - left, 3)}


def rejoin_sharded(exc: BaseException, membership: Membership, s: Setup, parts: Parts, model: nn.Module | None,
                   marks: Marks, objects: dict[str, Any], loaders: list[Loader | DataLoader[Any]],
                   ) -> tuple[DistEnv, int, Reloaded, dict[str, float]]:
    """``rejoin`` for a sharded model: FSDP2 taken off it (``fsdp_group``), the next group made, the same modules
    sharded on it and the newest snapshot or checkpoint loaded (``reload``). Returns (this rank's new place, the step
    to go on from, what was loaded, the seconds as ``rejoin``'s)."""
    from trainer.runtime import fsdp_group  # FSDP2 and DTensor: 0.6 s of imports no DDP job should pay at start

    if model is None:
        raise RuntimeError("no model was wrapped (Session.wrap)")
    began = time.monotonic()
    let_go(exc)
    settle_saves(parts, s.say)  # before the old group's modules are taken apart
    optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
    released = fsdp_group.release(model, optimizers, s.device)  # nothing holds the failed group's meshes now
    if parts.snapshots:
        parts.snapshots.close(finished=False)
    membership.leave()
    left = time.monotonic()
    env = tdist.regroup(membership, s.env)
    joined = time.monotonic()
    fsdp_group.remake(released)
    s, _, reloaded = reload(dataclasses.replace(s, env=env), str(parts.run.path), model, objects, marks)
    env, step = s.env, reloaded.resumption.step
    for loader in loaders:
        if not isinstance(loader, Loader):
            reshard(loader, env)
    return env, step, reloaded, {"abort_s": round(left - began, 3), "rendezvous_s": round(joined - left, 3)}


def within_budget(lost: list[int], membership: Membership, s: Setup, failures: int) -> None:
    """RegroupFailed when one more recovery would pass ``max_failures`` (TRAINER_MAX_FAILURES): ``failures`` the job
    had before this attempt, and its generations that began with a loss. Every survivor decides alike (the store's
    record of the generations), with no collective."""
    limit = s.job.max_failures
    if limit is not None and (had := failures + membership.losses()) + 1 > limit:
        raise RegroupFailed(f"{exits.names(lost)} lost, and the job has had {had} infrastructure "
                            f"failure(s) already (max_failures={limit}): the attempt ends")


def recover(exc: BaseException, lost: list[int], membership: Membership, s: Setup, parts: Parts,
            model: nn.Module | None, wrapper: nn.Module | None, marks: Marks, loaders: list[Loader | DataLoader[Any]],
            objects: dict[str, Any], config: dict[str, Any]) -> tuple[DistEnv, int, Parts]:
    """Collective among the survivors of ``lost`` (none: the group grows back, ``Grow``): ``rejoin``, then the
    session's parts for the new group (``s``: the session's setup, ``config``: what W&B records). Returns (this rank's
    place, the step to go on from, the parts); RegroupFailed, naming why, when any of it fails: the attempt ends and
    the restart path takes over."""
    noticed, began, was = time.time(), time.monotonic(), s.env.world_size
    if lost:
        within_budget(lost, membership, s, parts.failures)
    else:  # growing: the group is whole, and a background save may still use it
        parts.saves.checkpointer.wait()
    lost_at, held, reloaded = membership.lost_at(lost), marks.done, None
    try:
        if s.cfg.dist.sharded:
            env, step, reloaded, times = rejoin_sharded(exc, membership, s, parts, model, marks, objects, loaders)
            exact = True  # as a restart from that snapshot: the steps since it run again
        else:
            env, step, exact, times = rejoin(exc, membership, s.env, model, wrapper, marks, loaders,
                                             str(parts.run.path))
        s = dataclasses.replace(s, env=env, say=lambda msg: tdist.say(env, msg))  # rank 0 may have moved
        parts = regrouped_parts(parts, s, model, objects, step, config, wrapper, reloaded)
    except Exception as err:  # noqa: BLE001 - any of it: the attempt ends, the restart path takes over
        first = (str(err).strip().splitlines() or [""])[0][:200]
        what = f"{exits.names(lost)} lost and the others" if lost else "the group"
        raise RegroupFailed(f"{what} could not go on in place ({type(err).__name__}: {first}): the attempt "
                            "ends") from None
    exits.went_on_without(lost)
    total = time.monotonic() - began
    phases: dict[str, float | None] = {
        **times, "detection_s": round(max(0.0, noticed - lost_at), 3) if lost_at else None,
        "transfer_s": round(max(0.0, total - times["abort_s"] - times["rendezvous_s"]), 3)}
    again = (max(0, held - step), reloaded.resumption.facts["restored_from"]) if reloaded else None
    announce(parts.events.emit, s, membership.place, lost, was, step, exact, phases, total, lost_at or noticed, again)
    return env, step, parts


def announce(emit: Callable[..., None], s: Setup, place: Place, lost: list[int], was: int, step: int, exact: bool,
             times: dict[str, float | None], total_s: float, lost_at: float, again: tuple[int, str] | None = None,
             ) -> None:
    """On the new rank 0 (a survivor: the members are the survivors first, then the spares): the recovery as the next
    attempt of the job (``attempt`` event: ``0`` → ``0.1``, with ``regroup``), its ``regroup`` event (the first
    generation's ranks lost, the new members, the breakdown by phase) and one line. ``again``: a sharded model's
    steps run again since what it loaded, and from where (memory, disk)."""
    env = s.env
    why = {"regroup": True} if lost else {"grew": True}  # a loss counts against max_failures; growing back does not
    emit("attempt", durable=True, started=round(lost_at, 3), job_id=env.job_id, restart=s.job.restart_count,
         attempt=exits.later_attempt(exits.attempt_id(), place.generation), within=exits.attempt_id(), **why,
         nodes=env.num_nodes, processes=env.world_size, resumed_step=step, strategy=s.cfg.dist.strategy)
    emit("regroup", durable=True, step=step, lost=lost, generation=place.generation, members=list(place.members),
         world_size=place.world_size, was=was, exact=exact, **times, total_s=round(total_s, 3),
         **({"again": again[0], "restored_from": again[1]} if again else {}))
    source = {"memory": "a snapshot in node memory", "disk": "the checkpoint"}.get(again[1], "") if again else ""
    if not lost:
        via = f" (the sharded state of this step from {source})" if again else ""
        s.say(f"grew back: warm spares joined, {was} → {place.world_size} processes go on from step {step} in "
              f"{total_s:.2f} s{via}")
        return
    went = "a warm spare took the place: " if place.world_size >= was else ""
    size = f"{place.world_size} processes" if went else f"{place.world_size} of {was} processes"
    redo = f" ({again[0]} step(s) again: the lost shard came from {source})" if again else ""
    s.say(f"regrouped: {exits.names(lost)} lost; {went}{size} go on from step {step} in "
          f"{total_s:.2f} s{redo}")
