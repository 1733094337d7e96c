"""The runtime for a training loop you write yourself (the built-in trainer uses it too).

    with trainer.Session(sys.argv[1:]) as sess:             # process group, device, signals (key=value overrides)
        model = sess.wrap(Net())                             # DDP on this rank's device
        opt = torch.optim.AdamW(model.parameters())
        loader = sess.loader(dataset, batch_size=32)         # exact-resume sampler, position as state
        start = sess.restore(model=model, optimizer=opt, loader=loader)   # run folder; the step to continue from
        batches = loader.forever()
        for step in sess.steps(start, 1000):                 # step = start+1 … 1000
            loss = model(*next(batches)); loss.backward(); opt.step(); opt.zero_grad()
            sess.log({"loss": loss}, step)
            if sess.should_save(step):                       # signal or schedule, agreed by every rank
                sess.save(step)
                if sess.preempted:
                    break
        return sess.finish()                                 # 0, or 75 after a preemption save (launchers requeue)
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer.checkpoint import sharded_format
from trainer.checkpoint.base import Checkpointer
from trainer.checkpoint.resume import Resumed, for_this_start
from trainer.checkpoint.state import STATE_VERSION, PerRank, check_plain, collect, own_fields
from trainer.core import dist as tdist
from trainer.core import exits, hooks
from trainer.core.config import load, to_dict, to_yaml
from trainer.core.env import discover, job_info
from trainer.core.events import EventLog, process_start
from trainer.core.legacy import deprecations
from trainer.core.regroup import Grow
from trainer.core.schema import Config
from trainer.data.loader import Loader, eval_loader, loader_kwargs, train_loader
from trainer.data.workers import shutdown_workers, start_workers
from trainer.runtime import compile_cache, ddp_group, usage
from trainer.runtime.buckets import prime_when_resumed
from trainer.runtime.fsdp import eval_batches, no_sync, shard
from trainer.runtime.health.heartbeat import Heartbeat
from trainer.runtime.parts import Parts, Setup, close_parts, finished, open_parts
from trainer.runtime.records import attempts
from trainer.runtime.records.tracking import Tracker
from trainer.runtime.recovery import Marks, join, recover, take_over
from trainer.runtime.saving.saves import Saves
from trainer.runtime.saving.signals import Preemption, saving_signals
from trainer.runtime.usage import opened as _opened
from trainer.testing import faults

__all__ = ["STATE_VERSION", "PerRank", "Session", "check_plain"]

class Session:
    """One process's share of a job: from the environment and a config (``key=value`` overrides or a Config)."""

    def __init__(self, config: Config | list[str] | None = None, extra_config: Mapping[str, Any] | None = None) -> None:
        opened = time.time()  # the interpreter, the imports and the user's code before the session end here
        self.cfg = config if isinstance(config, Config) else load(list(config or []))
        self.extra_config = dict(extra_config or {})
        check_plain(self.extra_config, "Session(extra_config=…)")  # in every checkpoint: it must load back
        self.env = discover()
        self.cfg = for_this_start(self.cfg, self.env)  # resume=never: the job's first start only
        self.config_dict = to_dict(self.cfg)
        faults.install()  # the test faults TRAINER_FAULTS names, if any, at the runtime's one seam (core/hooks.py)
        self.job = job_info()
        self.device = tdist.pick_device(self.env, self.cfg.train.device, self.job.gpus_on_node)
        tdist.use_cpu_threads(self.env)
        self.signals = saving_signals(self.job.warning_signal)
        for note in deprecations:
            tdist.say(self.env, note)
        self._attributes()
        self.origin, self.membership, self.env = join(self.env, self.cfg, self.device, self.job)
        """``origin``: this process's rank as started (exit records, faults); ``env.rank``: its place now."""
        self.opened = (opened, time.time())  # (opened, process group up): the attempt event's start-up phases
        try:  # from here on a failure must not leave the process group behind
            self.preemption = Preemption(self.signals)
            torch.manual_seed(self.cfg.train.seed)
        except BaseException:
            tdist.teardown()
            raise

    def _attributes(self) -> None:
        """Every attribute exists before ``restore``, which opens the run folder and brings its parts (the watchdog, the
        checkpointer, the save policy, the tracker: trainer/runtime/parts.py); before it, using them says so."""
        self.parts: Parts | None = None
        self.marks: Marks | None = None
        self.objects: dict[str, Any] = {}
        self.loaders: list[Loader | DataLoader[Any]] = []
        self.resumed: Resumed | None = None
        """The checkpoint this run continued from (its path and state), after ``restore``."""
        self.step = 0
        """The last step ``steps`` handed out, ``should_save`` or ``save`` was given (or ``restore`` returned)."""
        self.steps_here = 0
        """Steps this process finished."""
        self.ended = False  # finish ran (else close warns: a loop that trained left no final checkpoint nor result)
        self.preempted_by: signal.Signals | None = None
        self.deadline = False
        """The job's time limit was near (no signal came in time): saved, and ``finish`` asks for a requeue."""
        self.summary: dict[str, Any] = {}
        """What ``finish`` wrote to result.json (on every rank)."""
        self.started_at = process_start()
        self.events = EventLog(None)
        """Rank 0's event log (events.jsonl), from ``restore`` on."""
        self.model: nn.Module | None = None
        """The model ``wrap`` placed (unwrapped; under fsdp the sharded module itself)."""
        self.wrapper: nn.Module | None = None
        """DDP around ``model`` (its forward broadcasts buffers: a wait the straggler meter leaves out)."""
        self.sharded_checkpoints = sharded_format(self.cfg.checkpoint.format, self.cfg.dist.sharded)

    @property
    def heartbeat(self) -> Heartbeat:
        """The hang watchdog of this rank (from ``restore``)."""
        return _opened(self.parts).heartbeat

    @property
    def saves(self) -> Saves:
        """The checkpointer (single-file or sharded alike), when to save, the last save and the stalls (``restore``)."""
        return _opened(self.parts).saves

    @property
    def checkpointer(self) -> Checkpointer:
        """Saves, waits for and finds this run's checkpoints, whatever their format (from ``restore``)."""
        return self.saves.checkpointer

    @property
    def last_path(self) -> Path | None:
        """The newest checkpoint of this run: saved, or resumed from."""
        return self.parts.saves.last_path if self.parts else None

    @property
    def tracker(self) -> Tracker:
        """W&B on rank 0, continued across requeues (from ``restore``)."""
        return _opened(self.parts).tracker

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that writes files, prints and talks to W&B."""
        return self.env.is_main

    @property
    def run_dir(self) -> Path:
        return _opened(self.parts).run.path

    def print(self, msg: str) -> None:
        """Print on rank 0 only."""
        tdist.say(self.env, msg)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model on this rank's device inside DDP, or with ``dist.strategy=fsdp`` sharded in place with FSDP2
        (blocks from ``model.fsdp_blocks()`` or found; returned as is); unwrapped in one process. Optimizer after."""
        usage.check_wrap(model)
        self.model = model.to(self.device)
        if self.env.world_size == 1:  # nothing to reduce or shard; DDP's constructor alone imports torch._dynamo (1-3 s)
            return self.model  # (checkpoints keep their format)
        if self.cfg.dist.sharded:
            return shard(self.model, self.cfg.train.precision, self.cfg.dist.activation_checkpointing)
        ddp = self.wrapper = ddp_group.wrap(self.model, self.device, sync=self.job.spare is None)  # spare: restore
        if self.env.world_size > 2:  # resumed, the first step sums in the uninterrupted run's order (runtime/buckets.py)
            prime_when_resumed(ddp, lambda: self.resumed is not None or self.job.spare is not None)
        return ddp

    def no_sync(self, model: nn.Module, skip: bool = True) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation: no gradient all-reduce (DDP) or reduce-scatter (FSDP) inside when ``skip``."""
        return no_sync(model, skip)

    def eval_batches(self, loader: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        """An evaluation loader's batches as ``(batch, counts)``; sharded, every rank runs as many (runtime/fsdp.py)."""
        return eval_batches(self.model, loader, self.device)

    def loader(self, dataset: Dataset[Any], batch_size: int, global_batch_size: int | None = None,
               accumulation: int = 1, **kwargs: Any) -> Loader:
        """This rank's batches of a training set, resumable to the exact batch (pass it to ``restore``). With
        ``global_batch_size``, ``batch_size`` caps the micro-batch and one optimizer step takes the same samples on any
        number of processes; without one, a job that may change size (a node range) keeps its first attempt's
        (``batch_size`` × ``accumulation`` × processes). Step every ``loader.accumulation`` micro-batches, read after
        ``restore``."""
        usage.check_loader(self.parts is not None)
        seed = self.cfg.train.seed
        made = train_loader(dataset, self.env, batch_size, global_batch_size, seed, self.print, accumulation,
                            self.job.resizable,
                            **loader_kwargs(dataset, self.env, self.device, seed, self.signals, kwargs))
        self.loaders.append(made)  # its DataLoader may be rebuilt at restore (a kept global batch)
        return made

    def eval_loader(self, dataset: Dataset[Any], batch_size: int, **kwargs: Any) -> DataLoader[Any]:
        """This rank's disjoint shard of an evaluation set (each sample counted once across ranks)."""
        made = eval_loader(dataset, self.env, batch_size,
                           **loader_kwargs(dataset, self.env, self.device, self.cfg.train.seed, self.signals, kwargs))
        self.loaders.append(made)
        if self.parts is not None:  # else at restore's end, before the loop's threads start
            start_workers(made)
        return made

    def describe(self, **facts: Any) -> None:
        """Record facts about this run (e.g. the code it trains) in its W&B config and checkpoints; before restore."""
        check_plain(facts, "describe()")
        self.extra_config.update(facts)

    def restore(self, **objects: Any) -> int:
        """Open the run folder, load the newest complete checkpoint into ``objects`` (state_dict holders, dicts, a
        PerRank) and return the step to continue from (0 on a fresh run)."""
        usage.check_restore(objects, self.model, self.loaders, self.env.world_size, self.parts is not None)
        self.objects, setup = objects, self._setup()
        if self.job.spare is not None and self.membership:  # a spare taking a lost rank's place: from the others
            self.step, self.parts, self.marks = take_over(setup, self.model, objects, self.wrapper)
            start_workers(*self.loaders)
            return self.step
        self.parts = p = open_parts(setup, self.model, objects, {**self.config_dict, **self.extra_config},
                                    to_yaml(self.cfg), self.wrapper)
        self.events, self.resumed, self.step = p.events, p.restored.resumed, p.restored.step
        compile_cache.keep_in(p.run.path)  # before the first forward compiles anything
        if self.env.is_main:
            self.events.emit("attempt", durable=True, **attempts.started(self.env, self.job, self.started_at, self.step,
                                                                 strategy=self.cfg.dist.strategy,
                                                                 cpu_threads=torch.get_num_threads(), marks=self.opened,
                                                                 **p.restored.facts))
        p.saves.say_cadence()  # after the attempt event: the report files it under this attempt
        usage.say_resumed(self.print, self.resumed, self.step, objects)
        start_workers(*self.loaders)  # now, before the loop's threads (trainer.data.workers)
        self.marks = Marks(objects, self.step) if self.membership else None
        return self.step

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """Steps ``start + 1`` … ``stop``, with hang watching from the first one on."""
        _opened(self.parts)
        for step in range(start + 1, stop + 1):
            self.heartbeat.beat("step", step)
            hooks.current().step_begin(self.steps_here, self.origin)
            self.step = step
            if self.marks:
                self.marks.begin(step, stop)
            yield step
            self.steps_here += 1
            if step == start + 1:  # the watchdog starts now: a first step may compile for minutes
                self.events.emit("first_step", step=step, stop=stop)
                self.heartbeat.start()

    def _setup(self) -> Setup:  # what the parts are built from, now
        return Setup(self.cfg, self.env, self.job, self.device, self.preemption, self.sharded_checkpoints, self.print,
                     self.membership)

    def regroup(self, exc: BaseException) -> int:
        """From the loop's ``except RuntimeError as exc:`` around ``steps``: a peer lost (TRAINER_STORE's store says so)
        or warm spares come (``Grow``): the members form a new group and go on here from the step returned (continue
        ``steps`` from it; a sharded model's is its newest snapshot's). Else: raised again."""
        m, p, grow = self.membership, _opened(self.parts), isinstance(exc, Grow)
        if m is None or self.marks is None or not isinstance(exc, RuntimeError) or not (grow or (lost := m.lost())):
            raise exc
        if grow and p.snapshots and self.cfg.dist.sharded:  # nothing lost: it loads this very step's
            p.snapshots.take(*self._state(self.step), self.step)
        self.env, self.step, self.parts = recover(exc, [] if grow else lost, m, self._setup(), p, self.model,
                                                  self.wrapper, self.marks, self.loaders, self.objects,
                                                  {**self.config_dict, **self.extra_config})
        self.events = self.parts.events
        return self.step

    def alive(self) -> None:
        """Progress inside a long phase whose length differs by rank (evaluation batches): refreshes the hang clock."""
        self.heartbeat.alive()

    def beat(self, phase: str) -> None:
        """Tell the hang watchdog where this rank is inside a step (named in a hang report)."""
        self.heartbeat.beat(phase, self.step)

    def log(self, metrics: Mapping[str, Any], step: int, console: bool = True) -> None:
        """Record metrics at ``step``: W&B and (``console``) one printed line, on rank 0. Tensors are read here, a
        sync with the device: log every few steps, not each."""
        values = usage.metric_values(metrics)
        if console:
            self.print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
        if self.parts is not None:  # logging before restore prints only
            self.parts.tracker.log(values, step)
        self.events.emit("metrics", step=step, values=values)

    def report(self, step: int, value: float | Mapping[str, float]) -> None:
        """Record an intermediate value at ``step`` (the sweep's metric, or metrics by name) for a sweep's pruner."""
        _opened(self.parts).reports.report(step, value)

    def should_prune(self) -> bool:
        """Collective, after ``report`` on every rank: whether the sweep's pruner stops this trial now (leave the loop
        and ``finish``: result.json says pruned). False outside a sweep with a pruner."""
        return _opened(self.parts).reports.should_prune()

    def request_stop(self, signum: int = signal.SIGUSR2) -> None:
        """Ask for save-and-requeue as a preemption signal would (0 does nothing); acted on by ``should_save``."""
        if signum:
            self.preemption.signum = signum

    def should_save(self, step: int, force_poll: bool = False) -> bool:
        """Whether to save now: a preemption signal or the job's time limit near (both then leave the loop:
        ``preempted``), ``checkpoint.every_steps``, ``every_minutes``, the auto cadence or a save-now file; agreed
        across ranks every ``checkpoint.poll_steps`` steps. Every rank must call it at the same steps."""
        p, self.step = _opened(self.parts), max(self.step, step)  # a loop of its own, without steps(), says it here
        self.request_stop(hooks.current().step_end(self.steps_here + 1, self.origin, self.job.warning_signal or
                                                   "SIGUSR2", p.run.path, p.heartbeat.alive,
                                                   lambda: bool(self.preemption.signum)))
        p.heartbeat.beat("flag all-reduce (signals, timed saves)", step)
        poll = p.group.policy.poll(step, force_poll)
        p.group.audit.after_step(step)
        if poll.polled:
            self.events.emit("progress", step=step)
        if poll.signum and self.preempted_by is None:
            self.events.emit("signal", durable=True, step=step, signal=signal.Signals(poll.signum).name)
        if poll.signum:
            self.preempted_by = signal.Signals(poll.signum)
        elif poll.deadline and not self.deadline:  # no signal came (or none was asked for): the time limit is near
            self.events.emit("deadline", durable=True, step=step, **self.saves.policy.deadline_facts())
            self.deadline = True
        if p.snapshots and not (poll.due or self.preempted) and p.snapshots.due(step):
            p.snapshots.take(*self._state(step), step)
            p.group.audit.synced()
        p.group.grow_if_due(step, poll.due or self.preempted or not self.marks or step >= self.marks.stop)  # all or none
        return poll.due or self.preempted

    @property
    def preempted(self) -> bool:
        """A preemption, the time limit or an audit's stop (a straggler to restart without, replicas that disagree)
        was agreed: save (``should_save`` said so), leave the loop, return ``finish()``."""
        return self.preempted_by is not None or self.deadline or bool(self.parts and self.parts.group.audit.stop)

    def save(self, step: int, blocking: bool | None = None) -> Path:
        """Collective: checkpoint every restored object at ``step`` (async per checkpoint.async_save, not when preempted)."""
        p, self.step = _opened(self.parts), max(self.step, step)
        if not p.group.audit.agree(step):  # never save a state the replicas dispute
            return self.last_path or p.run.checkpoints
        if blocking is None:
            blocking = self.preempted or not self.cfg.checkpoint.async_save
        path = self.saves.save(*self._state(step), step, blocking)
        p.group.audit.synced()  # the save's time and its waits are no rank's own
        self.tracker.flush()
        return path

    def _state(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: (what rank 0 writes, the models and optimizers written through DCP) of a save at ``step``."""
        through_dcp, state = collect(self.objects, self.sharded_checkpoints)
        state.update(own_fields(step, self.env.world_size, self.config_dict, self.tracker.run_id, self.extra_config))
        return state, through_dcp

    def finish(self, result: Mapping[str, Any] | None = None) -> int:
        """End the run: the final save (unless the last one holds this step), ``result.json`` with ``result`` added,
        and the exit code: 0, or 75 after a preemption save (with a requeue marker for launchers that cannot see it)."""
        p, self.ended = _opened(self.parts), True
        self.heartbeat.stop()
        self.checkpointer.wait_all()
        if self.saves.saved_step != self.step:
            self.save(self.step, blocking=True)  # committed before result.json says so and the snapshots go
        if p.snapshots:  # saved for good: the run's snapshots go (a failed attempt's stay for the restart)
            p.snapshots.close(finished=True)
        path = str(self.last_path)
        if p.group.audit.stop:  # the self-healing rules go on without the node it blames
            return p.group.audit.end()
        if self.preempted:
            at_limit = self.deadline or self.saves.policy.signal_at_limit(self.job.signal_grace_s)  # rank 0 marks
            return self.saves.requeue(p.run, self.step, self.preempted_by.name if self.preempted_by else None, at_limit)
        outcome = "pruned" if p.reports.pruned else "finished"
        self.summary = summary = {"outcome": outcome, "exit_code": 0, "run_dir": str(p.run.path), "checkpoint": path,
                   "global_step": self.step, "world_size": self.env.world_size, "rank": self.env.rank,
                   "resumed_from": str(self.resumed.path) if self.resumed else None,
                   "tracking_run_id": self.tracker.run_id, "checkpoint_stall_s": round(self.saves.stall_s, 4),
                   "strategy": self.cfg.dist.strategy, **(result or {})}
        finished(p, summary, self.step, self.cfg.run.report)
        return 0

    def close(self, exit_code: int = 0) -> None:
        """Stop the watchdog, wait for a background save, close W&B, put the signal handlers back, leave the group."""
        try:
            if self.parts is not None and not self.ended and not exit_code and self.step > self.parts.restored.step:
                self.print("warning: closed without finish(): no final checkpoint nor result.json (return sess.finish())")
            if self.parts is not None:
                close_parts(self.parts, exit_code)
        finally:
            for loader in self.loaders:
                shutdown_workers(loader.loader if isinstance(loader, Loader) else loader)
            self.events.close()
            self.preemption.restore()
            if self.marks:
                self.marks.close()
            if self.membership:  # ended on purpose, even by an error: the others must not regroup without it
                self.membership.close()
            tdist.teardown()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        with exits.signals_deferred([signal.SIGCHLD]):  # torch's raises after a worker died, till close
            if exc is not None:  # the loop raised: the report shows how the attempt ended
                exits.raised(exc, self.origin, self.step, self.events.emit)
            self.close(exit_code=0 if kind is None else 1)

