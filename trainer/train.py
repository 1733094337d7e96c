"""The built-in training loop: the user's (or a built-in) model, data and task under DDP, with exact resume,
periodic and preemption checkpoints, hang reports and tracking. Components own their state; the loop calls them."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint as ckpt
from trainer import faults as faults_mod
from trainer import resume
from trainer.build import build_parts
from trainer.config import Config, to_yaml
from trainer.data import loaders
from trainer.dist import gather, say
from trainer.env import DistEnv, job_info
from trainer.errors import EXIT_REQUEUE, UserError
from trainer.faults import Faults
from trainer.heartbeat import Heartbeat
from trainer.metrics import Meter, progress_bar, reduce_sums
from trainer.oom import out_of_memory
from trainer.preemption import Preemption, SavePolicy
from trainer.rundir import RunDir
from trainer.task import batch_size, split_output, to_device
from trainer.tracking import Tracker


def lr_factor(cfg: Config, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine to zero (or constant)."""
    warm = cfg.optim.warmup_steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.optim.schedule == "constant":
            return 1.0
        done = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    return factor


def param_checksum(model: nn.Module) -> str:
    """A digest of every parameter's bytes: equal on all ranks iff their weights are identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Trainer:
    """One process's share of a DDP run: built from the config, then ``fit()``."""

    def __init__(self, cfg: Config, env: DistEnv, device: torch.device, preemption: Preemption,
                 signals: tuple[int, ...], faults: Faults) -> None:
        self.cfg, self.env, self.device, self.preemption, self.faults = cfg, env, device, preemption, faults
        self.progress = ckpt.Progress()  # first: an out-of-memory report from construction names the step
        try:
            self._build(signals)
        except torch.OutOfMemoryError as exc:  # the model to the device, a resumed checkpoint, DDP's broadcast
            raise out_of_memory(exc, cfg, env, device, self.progress, setup=True) from None

    def _build(self, signals: tuple[int, ...]) -> None:
        cfg, env, device = self.cfg, self.env, self.device
        torch.manual_seed(cfg.train.seed)
        if cfg.train.deterministic and device.type == "cuda":
            # cuBLAS is deterministic only with a fixed workspace, read when its handle is made (first matmul,
            # still ahead); without it torch raises from inside the first linear layer.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(cfg.train.deterministic)
        parts = build_parts(cfg)  # the user's code runs before the run folder exists: a bad plugin leaves nothing
        self.task, self.record, self.data = parts.task, parts.record, parts.data
        self.run = RunDir.open(env, cfg.run.dir, to_yaml(cfg))
        self.heartbeat = Heartbeat(env, self.run.hang, cfg.dist.heartbeat_s)
        self.checkpointer = ckpt.Checkpointer(self.run.checkpoints, env.is_main, cfg.checkpoint.keep,
                                              self.faults.save_delay_s, on_write=self.heartbeat.alive)
        self.train_loader, self.sampler, self.eval_loader = loaders(parts.data, cfg, env, device, signals)
        self.model = parts.model.to(device)
        o = cfg.optim
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(self.model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
            if o.name == "sgd" else torch.optim.AdamW(self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay))
        if self.sampler is None:  # an iterable set has no length: train.max_steps (required) decides
            self.total_steps = cfg.train.max_steps
        else:
            self.total_steps = math.ceil(len(self.train_loader) / o.grad_accum) * cfg.train.epochs
            self.total_steps = min(self.total_steps, cfg.train.max_steps or self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg, self.total_steps))
        self.scaler = torch.amp.GradScaler(enabled=cfg.train.precision == "fp16")

        found = resume.find(cfg, env, self.run.path)
        tracking_id = self.restore(found) if found else None
        self.resumed_from = found.path if found else None
        # (step, path) of the newest checkpoint holding this run's state: the final save is skipped when it exists.
        self.saved = (self.progress.global_step, found.path) if found else None

        # The optimizer holds the unwrapped parameters; every forward goes through the DDP wrapper.
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.net: nn.Module = torch.compile(self.ddp) if cfg.train.compile else self.ddp  # type: ignore[assignment]
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
        self.batches: Any = None  # the epoch's iterator, started by start_epoch
        self.epoch_len = 0
        self.policy = SavePolicy(cfg.checkpoint, env, device, self.preemption)
        self.tracker = Tracker(cfg, env, job_info(), self.run.path)
        self.tracker.start({**self.config_dict(), "plugins": self.record}, tracking_id)

    def config_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.structured(self.cfg))  # type: ignore[return-value]

    def restore(self, found: resume.Resumed) -> str | None:
        """Load a checkpoint into every stateful part; return its tracking run id."""
        state, env = found.state, self.env
        resume.load_model(self.model, state["model"], found.path, self.record)  # before DDP wraps the model
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        resume.notes(self.cfg, env, state, self.record)
        exact = resume.restore_position(self.progress, state, self.cfg, env)
        if self.sampler is None:  # an iterable set: its own state_dict is its position, or the epoch restarts
            data_state = (state.get("data") or [None] * env.world_size)[env.rank] if exact else None
            if data_state is not None and _stateful(self.data.train):
                self.data.train.load_state_dict(data_state)  # type: ignore[attr-defined]
            else:
                say(env, "note: the iterable data set has no state_dict/load_state_dict (or the world size changed): "
                         "its stream starts again from the beginning of an epoch")
        say(env, f"resumed from {found.path} at epoch {self.progress.epoch}, step {self.progress.global_step}")
        return state["tracking"].get("run_id")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs (the ranks' RNG states are added by the checkpointer)."""
        train_set: Any = self.data.train
        data_state = train_set.state_dict() if self.sampler is None and _stateful(train_set) else None
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "config": self.config_dict(),
            "plugins": self.record,
            "progress": asdict(self.progress),
            "world_size": self.env.world_size,
            "data": gather(data_state) if self.sampler is None else None,
            "tracking": {"run_id": self.tracker.run_id},
            "version": ckpt.FORMAT_VERSION,
        }

    def save(self, blocking: bool = True) -> Any:
        self.heartbeat.beat("checkpoint save")
        # Rank 0 beats while it writes; the others only wait for it, for as long as the write takes.
        with self.heartbeat.waiting(not self.env.is_main):
            path = self.checkpointer.save(self.state(), self.progress.global_step, blocking=blocking)
        self.saved = self.progress.global_step, path
        self.policy.saved()
        return path

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's metrics over the whole evaluation set, each rank scoring its shard, summed across ranks."""
        if self.eval_loader is None:
            return {}
        # The unwrapped model: a DDP forward broadcasts buffers, a collective that ranks with one batch
        # fewer (shards differ by up to one sample) would never join.
        self.model.eval()
        sums: dict[str, list[Any]] = {}
        for batch in self.eval_loader:
            self.heartbeat.alive()  # shards differ by a batch: not a lockstep beat
            with self.autocast():
                out = self.task.eval_step(self.model, to_device(batch, self.device))
            for name, (s, n) in out.items():
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + s, acc[1] + n
        self.heartbeat.beat("evaluation all-reduce")
        scores = reduce_sums({k: [float(s), float(n)] for k, (s, n) in sums.items()})
        self.model.train()
        return scores

    def start_epoch(self) -> None:
        """A new iterator over the training set; a map-style set's sampler skips what this epoch already trained on."""
        p = self.progress
        if self.sampler is not None:
            self.sampler.start_epoch(p.epoch, p.batches_in_epoch * self.cfg.data.batch_size)
            self.epoch_len = len(self.train_loader) + p.batches_in_epoch
        self.batches = iter(self.train_loader)

    def running(self) -> bool:
        """Whether another optimizer step is due: epochs (map-style sets) and train.max_steps decide."""
        p, t = self.progress, self.cfg.train
        if self.sampler is None:
            return p.global_step < t.max_steps
        return p.epoch < t.epochs and not (t.max_steps and p.global_step >= t.max_steps)

    def next_batch(self) -> Any:
        """The next training batch; an iterable set that runs dry starts its stream again (a new epoch)."""
        p = self.progress
        assert self.batches is not None
        try:
            return next(self.batches)
        except StopIteration:
            if self.sampler is not None:
                raise
        p.epoch, p.batches_in_epoch = p.epoch + 1, 0
        self.batches = iter(self.train_loader)
        try:
            return next(self.batches)
        except StopIteration:
            raise UserError("data.target", "the iterable training set yields no batches",
                            "check the data set's __iter__, and that each rank gets samples") from None

    def train_window(self, window: int) -> None:
        """One optimizer step over ``window`` micro-batches; gradients are all-reduced on the last one only."""
        hb, step = self.heartbeat, self.progress.global_step
        for i in range(window):
            hb.beat("data loading", step)
            self.faults.before_batch(self.micro, self.env.rank)
            batch = to_device(self.next_batch(), self.device)
            sync = contextlib.nullcontext() if i == window - 1 else self.ddp.no_sync()
            hb.beat("forward")
            with sync, self.autocast():
                loss, extra = split_output(self.task.training_step(self.net, batch))
            hb.beat("backward (gradient all-reduce)" if i == window - 1 else "backward")
            self.scaler.scale(loss / window).backward()
            n = batch_size(batch) * self.env.world_size
            self.meter.add(loss, extra, n)
            self.samples_seen += n
            self.micro += 1
            self.preemption.signum = self.faults.after_micro_step(self.micro, self.cfg.checkpoint.signal) or \
                self.preemption.signum
        hb.beat("optimizer step")
        if self.cfg.optim.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.meter.steps += 1
        self.progress.batches_in_epoch += window

    def fit(self) -> dict[str, Any]:
        """Train to the configured epochs or until preempted; return the run's summary."""
        try:
            result = self._fit()
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(exc, self.cfg, self.env, self.device, self.progress) from None
        finally:
            self.heartbeat.stop()
            self.checkpointer.wait()
            self.tracker.finish()
        return result

    def _fit(self) -> dict[str, Any]:
        cfg, env, p = self.cfg, self.env, self.progress
        global_batch = cfg.data.batch_size * env.world_size * cfg.optim.grad_accum
        say(env, f"run {self.run.path} | {env.world_size} process(es) via {env.source} on {self.device.type} | "
                 f"{self.record['model']['target']} on {self.record['data']['target']} | global batch {global_batch} | "
                 f"{self.total_steps} steps")
        self.meter, self.micro, self.samples_seen = Meter(), 0, 0
        bar = progress_bar(env, self.total_steps, p.global_step)
        started, eval_time, first_step_at = time.perf_counter(), 0.0, None
        scores: dict[str, float] | None = None  # evaluation metrics at step scored_at
        scored_at = -1
        self.net.train()
        while self.running():
            if self.batches is None:
                self.start_epoch()
            window = cfg.optim.grad_accum if self.sampler is None else \
                min(cfg.optim.grad_accum, self.epoch_len - p.batches_in_epoch)
            self.train_window(window)
            p.global_step += 1
            if first_step_at is None:  # the watchdog starts now: a first step may compile for minutes
                first_step_at = time.time()
                self.heartbeat.start()
            self.faults.after_step()
            self.report(bar)
            epoch_done = self.sampler is not None and p.batches_in_epoch >= self.epoch_len
            if epoch_done:  # evaluated before any save, and saved as the next epoch's start
                p.epoch, p.batches_in_epoch, self.batches = p.epoch + 1, 0, None
            every = cfg.train.eval_every
            if (every and p.global_step % every == 0) or (epoch_done and not every):
                t_eval = time.perf_counter()
                scores, scored_at = self.evaluate(), p.global_step
                eval_time += time.perf_counter() - t_eval
                self.log_scores(scores)
            signum, due = self.policy.poll(p.global_step, force=epoch_done)
            if signum:
                return self.preempted(signal.Signals(signum), bar)
            if due:
                self.save(blocking=not cfg.checkpoint.async_save)
        train_time = time.perf_counter() - started - eval_time
        self.heartbeat.stop()
        if bar is not None:
            bar.close()
        self.checkpointer.wait()
        # The final state is saved once: not again when the last periodic save already holds it.
        final = self.saved[1] if self.saved and self.saved[0] == p.global_step else self.save()
        if scored_at != p.global_step:
            scores = self.evaluate()
            self.log_scores(scores)
        result: dict[str, Any] = {
            "outcome": "finished",
            "exit_code": 0,
            "run_dir": str(self.run.path),
            "checkpoint": str(final),
            **{f"test_{k}": v for k, v in (scores or {}).items()},
            "global_step": p.global_step,
            "world_size": env.world_size,
            "rank": env.rank,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "tracking_run_id": self.tracker.run_id,
            "train_time_s": train_time,  # the training loop alone: evaluation excluded, this process's start-up too
            "train_samples_per_s": self.samples_seen / max(1e-9, train_time),
            "first_step_at": first_step_at,  # wall-clock time.time() when the first optimizer step ended
            "plugins": self.record,
        }
        if not cfg.task.target:
            result["chance_accuracy"] = 1 / cfg.model.num_classes
        if cfg.train.checksum:  # a full copy of the model to the CPU on every rank: opt-in
            result["param_checksums"] = gather(param_checksum(self.model))
        self.run.write_result(result)
        self.tracker.finish({**{f"test/{k}": v for k, v in (scores or {}).items()}, "global_step": p.global_step})
        say(env, f"done: {self.summary(scores or {})}; checkpoint {final}")
        return result

    def summary(self, scores: dict[str, float]) -> str:
        """The evaluation in words: test accuracy against chance for the built-in task, else every metric."""
        if not scores:
            return "no evaluation set"
        words = [f"test {k} {v:.4g}" for k, v in scores.items() if k != "accuracy"]
        if "accuracy" in scores:
            chance = f" (chance {100 / self.cfg.model.num_classes:.0f}%)" if not self.cfg.task.target else ""
            words.insert(0, f"test accuracy {100 * scores['accuracy']:.2f}%{chance}")
        return ", ".join(words)

    def log_scores(self, scores: dict[str, float]) -> None:
        p = self.progress
        self.tracker.log({**{f"eval/{k}": v for k, v in scores.items()}, "epoch": p.epoch}, p.global_step)
        if scores:
            say(self.env, f"\nstep {p.global_step} (epoch {p.epoch}): "
                          + ", ".join(f"eval {k} {v:.4f}" for k, v in scores.items()))

    def preempted(self, sig: signal.Signals, bar: Any) -> dict[str, Any]:
        """Save once, leave a requeue marker, and report exit code 75."""
        self.heartbeat.stop()  # the launcher's kill deadline bounds what follows
        if bar is not None:
            bar.close()
        path = self.save()
        # For launchers that cannot see our exit code (torchrun's agent turns 75 into 1).
        self.run.mark_requeue({"signal": sig.name, "checkpoint": str(path), "step": self.progress.global_step})
        torch.distributed.barrier()  # the marker exists before any rank exits (srun may then kill the rest)
        say(self.env, f"\n{sig.name} received: saved {path} at step {self.progress.global_step}; "
                      f"exiting with {EXIT_REQUEUE} so the launcher requeues")
        return {"outcome": "preempted", "exit_code": EXIT_REQUEUE, "run_dir": str(self.run.path), "rank": self.env.rank,
                "signal": sig.name, "checkpoint": str(path)}

    def report(self, bar: Any) -> None:
        """Progress bar or log line, and tracking, from rank 0."""
        step = self.progress.global_step
        if not self.env.is_main:
            return
        if bar is not None:
            bar.update(1)
        if step % self.cfg.train.log_every and not (bar is not None and step % 10 == 0):
            return
        m = self.meter.metrics(float(self.scheduler.get_last_lr()[0]))
        self.meter.reset()
        if bar is not None:
            bar.set_postfix(loss=f"{m['train/loss']:.4f}", samples_s=f"{m['train/samples_per_s']:.0f}")
        else:
            print(f"epoch {self.progress.epoch} step {step}: loss {m['train/loss']:.4f}, "
                  f"{m['train/samples_per_s']:.0f} samples/s, lr {m['train/lr']:.4g}", flush=True)
        self.tracker.log(m, step)


def fit(cfg: Config, env: DistEnv, device: torch.device) -> dict[str, Any]:
    """Train to the configured epochs or until preempted; return the run's summary."""
    faults = faults_mod.load()
    preempt_signal = getattr(signal, cfg.checkpoint.signal)
    signals = tuple({preempt_signal, signal.SIGTERM})
    preemption = Preemption(signals)
    try:
        return Trainer(cfg, env, device, preemption, signals, faults).fit()
    finally:
        preemption.restore()
