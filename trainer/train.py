"""The training loop: DDP, accumulation, AMP, evaluation, periodic and preemption checkpoints, tracking."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint as ckpt
from trainer.config import Config, to_yaml
from trainer.data import build_data, loaders
from trainer.env import DistEnv, job_info
from trainer.errors import EXIT_REQUEUE, UserError
from trainer.heartbeat import HANG_FOLDER, Heartbeat, set_aside
from trainer.models import build_model
from trainer.tracking import Tracker


class Preemption:
    """Sets a flag when a preemption signal arrives; the loop acts on it at the next step boundary."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signum = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum  # no I/O in a handler: it may interrupt a write

    def restore(self) -> None:
        """Put back the handlers that were there before (e.g. submitit's)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def say(env: DistEnv, msg: str) -> None:
    """Print from rank 0 only; everything a user reads goes through here."""
    if env.is_main:
        print(msg, flush=True)


def on_main(env: DistEnv, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and hand its result, or its UserError, to every rank: no rank is left waiting."""
    box: list[Any] = [None]
    if env.is_main:
        try:
            box[0] = ("ok", fn())
        except UserError as err:
            box[0] = ("error", (err.field, err.message, err.hint))
        except Exception as exc:  # re-raised on rank 0 with its traceback, reported on the others
            box[0] = ("crash", f"{type(exc).__name__}: {exc}")
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise UserError(*value)
    if kind == "crash":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def choose_run_dir(cfg: Config, env: DistEnv) -> Path:
    """The run folder, decided and created on rank 0: a requeued Slurm job finds its own folder again."""

    def make() -> str:
        if cfg.run.dir:
            path = Path(cfg.run.dir).resolve()
        else:
            path = Path("runs", env.job_id or datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
            if not env.job_id and path.exists():
                path = Path(f"{path}-{time.time_ns() % 10**6}")
        try:
            path.mkdir(parents=True, exist_ok=True)
            ckpt.write_atomic(path / "config.yaml", to_yaml(cfg).encode())
            # Before the broadcast below, so before any rank's watchdog: an earlier attempt's files would
            # complete rank 0's wait for every rank at once and hand the other ranks a stale report.
            moved = set_aside(path / HANG_FOLDER)
            if moved:
                say(env, f"note: the previous attempt's hang diagnostics were moved to {moved}")
        except OSError as exc:
            raise UserError("run.dir", f"cannot write {str(path)!r} ({exc.strerror})",
                            "choose a folder this user can write, on storage every node shares") from None
        return str(path)

    return Path(on_main(env, make))


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


class Meter:
    """Loss and throughput since the last report (rank 0's view)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss, self.n, self.steps, self.samples, self.t0 = 0.0, 0, 0, 0, time.perf_counter()

    def add(self, loss: float, samples: int) -> None:
        self.loss += loss
        self.n += 1
        self.samples += samples

    def metrics(self, lr: float) -> dict[str, float]:
        elapsed = max(1e-9, time.perf_counter() - self.t0)
        out = {"train/loss": self.loss / max(1, self.n), "train/lr": lr, "train/samples_per_s": self.samples / elapsed,
               "train/step_time_s": elapsed / max(1, self.steps)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["gpu/max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out


class Trainer:
    """One process's share of a DDP run: built from the config, then ``fit()``."""

    def __init__(self, cfg: Config, env: DistEnv, device: torch.device, preemption: Preemption,
                 signals: tuple[int, ...]) -> None:
        self.cfg, self.env, self.device, self.preemption = cfg, env, device, preemption
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
        data = build_data(cfg)  # before the run folder exists: a missing data set must leave nothing behind
        self.run_dir = choose_run_dir(cfg, env)
        self.requeue_marker = self.run_dir / "requeue.json"
        if env.is_main:
            self.requeue_marker.unlink(missing_ok=True)
        self.heartbeat = Heartbeat(env, self.run_dir / HANG_FOLDER, cfg.dist.heartbeat_s)
        self.checkpointer = ckpt.Checkpointer(self.run_dir / "checkpoints", env.is_main, cfg.checkpoint.keep,
                                              cfg.debug.save_delay_s, on_write=self.heartbeat.alive)
        self.train_loader, self.sampler, self.test_loader = loaders(data, cfg, env, device, signals)
        self.model = build_model(cfg.model, data.in_channels, data.image_size).to(device)
        o = cfg.optim
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(self.model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
            if o.name == "sgd" else torch.optim.AdamW(self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay))
        self.total_steps = math.ceil(len(self.train_loader) / o.grad_accum) * cfg.train.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg, self.total_steps))
        self.scaler = torch.amp.GradScaler(enabled=cfg.train.precision == "fp16")

        self.resumed_from, tracking_id = self.resume()
        # (step, path) of the newest checkpoint holding this run's state: the final save is skipped when it exists.
        self.saved: tuple[int, Path] | None = (self.progress.global_step, self.resumed_from) if self.resumed_from else None
        if self.resumed_from:
            say(env, f"resumed from {self.resumed_from} at epoch {self.progress.epoch}, step {self.progress.global_step}")

        # The optimizer holds the unwrapped parameters; every forward goes through the DDP wrapper.
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.net: nn.Module = torch.compile(self.ddp) if cfg.train.compile else self.ddp  # type: ignore[assignment]
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
        self.tracker = Tracker(cfg, env, job_info(), self.run_dir)
        self.tracker.start(self.config_dict(), tracking_id)

    def config_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.structured(self.cfg))  # type: ignore[return-value]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs (the ranks' RNG states are added by the checkpointer)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "config": self.config_dict(),
            "progress": asdict(self.progress),
            "world_size": self.env.world_size,
            "tracking": {"run_id": self.tracker.run_id},
            "version": ckpt.FORMAT_VERSION,
        }

    def save(self, blocking: bool = True) -> Path:
        self.heartbeat.beat("checkpoint save")
        # Rank 0 beats while it writes; the others only wait for it, for as long as the write takes.
        with self.heartbeat.waiting(not self.env.is_main):
            path = self.checkpointer.save(self.state(), self.progress.global_step, blocking=blocking)
        self.saved = self.progress.global_step, path
        return path

    def resume(self) -> tuple[Path | None, str | None]:
        """Load the checkpoint ``checkpoint.resume`` points to; return its path and tracking run id."""
        cfg, env = self.cfg, self.env
        if cfg.checkpoint.resume == "never":
            return None, None
        explicit = None if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)

        def pick() -> str | None:
            # The run's own newest checkpoint wins: a requeued job that was started from PATH continues
            # from where it got to, not from PATH again.
            for target in [self.run_dir, *([explicit] if explicit else [])]:
                try:
                    found = ckpt.find_resumable(target)
                except Exception as exc:
                    raise UserError("checkpoint.resume", f"cannot read {str(target)!r} ({exc})",
                                    "pass a checkpoint file or run folder written by this trainer") from None
                if found:
                    return str(found[0])
            if explicit:
                raise UserError("checkpoint.resume", f"no complete checkpoint in {str(explicit)!r}",
                                "pass a step_*.pt file with its .json manifest, or a run folder holding checkpoints/")
            return None

        # Rank 0 picks (and verifies) the checkpoint, so warnings appear once and all ranks load the same one.
        chosen = on_main(env, pick)
        if chosen is None:
            return None, None
        path = Path(chosen)
        state = torch.load(path, map_location="cpu", weights_only=True)  # before DDP wraps the model
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        for k, v in state["progress"].items():
            setattr(self.progress, k, v)
        if state["world_size"] != env.world_size:
            # batches_in_epoch counts per rank: convert through the samples the whole job consumed.
            consumed = self.progress.batches_in_epoch * state["config"]["data"]["batch_size"] * state["world_size"]
            self.progress.batches_in_epoch = consumed // (cfg.data.batch_size * env.world_size)
        for group, key in (("data", "name"), ("data", "batch_size"), ("optim", "grad_accum"), ("train", "seed")):
            was, now = state["config"][group][key], getattr(getattr(cfg, group), key)
            if was != now:
                say(env, f"note: {group}.{key} was {was!r} in the checkpoint, now {now!r}: training continues, "
                         "but not as the original run would")
        if state["world_size"] == env.world_size:
            ckpt.set_rng_state(state["rng"][env.rank])
        else:
            say(env, f"note: checkpoint was written by {state['world_size']} processes, now {env.world_size}: the epoch "
                     "continues after the samples already seen (to within one batch), but not bit-exactly")
        return path, state["tracking"].get("run_id")

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Loss and accuracy over the whole test set, each rank scoring its shard, summed across ranks."""
        # The unwrapped model: a DDP forward broadcasts buffers, a collective that ranks with one batch
        # fewer (shards differ by up to one sample) would never join.
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y in self.test_loader:
            self.heartbeat.alive()  # shards differ by a batch: not a lockstep beat
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.autocast():
                out = self.model(x)
            totals[0] += F.cross_entropy(out.float(), y, reduction="sum").item()
            totals[1] += (out.argmax(1) == y).sum().item()
            totals[2] += y.numel()
        self.heartbeat.beat("evaluation all-reduce")
        dist.all_reduce(totals)
        self.model.train()
        return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()

    def train_window(self, batches: Iterator[Any], window: int) -> None:
        """One optimizer step over ``window`` micro-batches; gradients are all-reduced on the last one only."""
        hb, step = self.heartbeat, self.progress.global_step
        for i in range(window):
            hb.beat("data loading", step)
            if self.micro == self.cfg.debug.hang_at_step and self.env.rank == self.cfg.debug.hang_rank:
                _stuck_for_test()
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            sync = contextlib.nullcontext() if i == window - 1 else self.ddp.no_sync()
            hb.beat("forward")
            with sync, self.autocast():
                loss = F.cross_entropy(self.net(x).float(), y) / window
            hb.beat("backward (gradient all-reduce)" if i == window - 1 else "backward")
            self.scaler.scale(loss).backward()
            self.meter.add(loss.item() * window, x.shape[0] * self.env.world_size)
            self.samples_seen += x.shape[0] * self.env.world_size
            self.micro += 1
            if self.micro == self.cfg.debug.oom_at_step + 1:
                raise torch.OutOfMemoryError("simulated out of memory (debug.oom_at_step)")
            if self.micro == self.cfg.debug.preempt_at_step + 1:  # test hook: as if the signal arrived now
                self.preemption.signum = getattr(signal, self.cfg.checkpoint.signal)
        hb.beat("optimizer step")
        if self.cfg.optim.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.meter.steps += 1

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
        say(env, f"run {self.run_dir} | {env.world_size} process(es) via {env.source} on {self.device.type} | "
                 f"{cfg.model.name} on {cfg.data.name} | global batch {global_batch} | {self.total_steps} steps")
        self.meter, self.micro, self.samples_seen = Meter(), 0, 0
        bar = _progress_bar(env, self.total_steps, p.global_step)
        started, eval_time, first_step_at = time.perf_counter(), 0.0, None
        last_save_time = time.monotonic()
        scores: tuple[float, float] | None = None  # test loss and accuracy after the last finished epoch
        self.net.train()
        while p.epoch < cfg.train.epochs:
            self.sampler.start_epoch(p.epoch, p.batches_in_epoch * cfg.data.batch_size)
            batches = iter(self.train_loader)
            n_batches = len(self.train_loader) + p.batches_in_epoch
            while p.batches_in_epoch < n_batches:
                window = min(cfg.optim.grad_accum, n_batches - p.batches_in_epoch)
                self.train_window(batches, window)
                p.batches_in_epoch += window
                p.global_step += 1
                if first_step_at is None:  # the watchdog starts now: a first step may compile for minutes
                    first_step_at = time.time()
                    self.heartbeat.start()
                if cfg.debug.step_delay_s:
                    time.sleep(cfg.debug.step_delay_s)
                self.report(bar)
                epoch_done = p.batches_in_epoch >= n_batches
                if epoch_done:  # evaluated before any save, and saved as the next epoch's start
                    p.epoch, p.batches_in_epoch = p.epoch + 1, 0
                    t_eval = time.perf_counter()
                    scores = self.evaluate()
                    eval_time += time.perf_counter() - t_eval
                    self.tracker.log({"eval/loss": scores[0], "eval/accuracy": scores[1], "epoch": p.epoch},
                                     p.global_step)
                    say(env, f"\nepoch {p.epoch}/{cfg.train.epochs}: test loss {scores[0]:.4f}, "
                             f"accuracy {100 * scores[1]:.2f}%")

                # Every poll_steps steps, one small all-reduce tells every rank whether anyone was signalled
                # and whether rank 0's clock says a timed save is due, so all ranks save together.
                signum, due = 0, False
                if p.global_step % cfg.checkpoint.poll_steps == 0 or epoch_done:
                    due = (cfg.checkpoint.every_minutes > 0 and env.is_main
                           and time.monotonic() - last_save_time >= 60 * cfg.checkpoint.every_minutes)
                    flags = torch.tensor([self.preemption.signum, float(due)], device=self.device)
                    self.heartbeat.beat("flag all-reduce (signals, timed saves)")
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                    signum, due = int(flags[0].item()), bool(flags[1].item())
                if signum:
                    return self.preempted(signal.Signals(signum), bar)
                every = cfg.checkpoint.every_steps
                if (every and p.global_step % every == 0) or due:
                    self.save(blocking=not cfg.checkpoint.async_save)
                    last_save_time = time.monotonic()
                if epoch_done:
                    break
        train_time = time.perf_counter() - started - eval_time
        self.heartbeat.stop()
        if bar is not None:
            bar.close()
        self.checkpointer.wait()
        # The final state is saved once: not again when the last periodic save already holds it.
        final = self.saved[1] if self.saved and self.saved[0] == p.global_step else self.save()
        test_loss, test_acc = scores or self.evaluate()
        checksums: list[str | None] = [None] * env.world_size
        dist.all_gather_object(checksums, param_checksum(self.model))
        result = {
            "outcome": "finished",
            "exit_code": 0,
            "run_dir": str(self.run_dir),
            "checkpoint": str(final),
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "chance_accuracy": 1 / cfg.model.num_classes,
            "global_step": p.global_step,
            "world_size": env.world_size,
            "param_checksums": checksums,
            "rank": env.rank,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "tracking_run_id": self.tracker.run_id,
            "train_time_s": train_time,  # the training loop alone: evaluation excluded, this process's start-up too
            "train_samples_per_s": self.samples_seen / max(1e-9, train_time),
            "first_step_at": first_step_at,  # wall-clock time.time() when the first optimizer step ended
        }
        if env.is_main:
            ckpt.write_atomic(self.run_dir / "result.json", json.dumps(result, indent=1).encode())
        self.tracker.finish({"test/accuracy": test_acc, "test/loss": test_loss, "global_step": p.global_step})
        say(env, f"done: test accuracy {100 * test_acc:.2f}% (chance {100 / cfg.model.num_classes:.0f}%), checkpoint {final}")
        return result

    def preempted(self, sig: signal.Signals, bar: Any) -> dict[str, Any]:
        """Save once, leave a requeue marker, and report exit code 75."""
        self.heartbeat.stop()  # the launcher's kill deadline bounds what follows
        if bar is not None:
            bar.close()
        path = self.save()
        if self.env.is_main:  # for launchers that cannot see our exit code (torchrun's agent turns 75 into 1)
            marker = {"signal": sig.name, "checkpoint": str(path), "step": self.progress.global_step}
            ckpt.write_atomic(self.requeue_marker, json.dumps(marker).encode())
        dist.barrier()  # the marker exists before any rank exits (srun may then kill the rest)
        say(self.env, f"\n{sig.name} received: saved {path} at step {self.progress.global_step}; "
                      f"exiting with {EXIT_REQUEUE} so the launcher requeues")
        return {"outcome": "preempted", "exit_code": EXIT_REQUEUE, "run_dir": str(self.run_dir), "rank": self.env.rank,
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


def out_of_memory(exc: BaseException, cfg: Config, env: DistEnv, device: torch.device, progress: ckpt.Progress,
                  setup: bool = False) -> UserError:
    """What to print when this rank runs out of memory; nothing is saved, so the last checkpoint stays intact.

    A function, not a Trainer method: construction (``setup``) may fail before there is a Trainer to ask.
    """
    if device.type == "cuda":
        print(torch.cuda.memory_summary(device, abbreviated=True), file=sys.stderr, flush=True)
    b, accum = cfg.data.batch_size, cfg.optim.grad_accum
    if setup:  # before the first batch: the weights, optimizer state or DDP's buckets do not fit, whatever the batch
        key, where = "model.name", f"rank {env.rank}, setting up before step {progress.global_step}"
        hints = ["check that nothing else holds this GPU's memory (nvidia-smi): one trainer process per GPU",
                 f"a smaller model than {cfg.model.name}, or a GPU with more memory", "checkpoints are untouched"]
    else:
        key, where = "data.batch_size", f"rank {env.rank}, step {progress.global_step}, epoch {progress.epoch}"
        hints = [f"halve the batch and keep the global batch: data.batch_size={max(1, b // 2)} "
                 f"optim.grad_accum={accum * 2}"]
        if cfg.train.precision == "fp32":
            hints.append("train.precision=bf16 (about half the activation memory)")
        hints += ["activation checkpointing (torch.utils.checkpoint) in the model's largest blocks",
                  "evaluation already runs under torch.no_grad; a checkpoint, if any, is untouched"]
    first_line = (str(exc).splitlines() or [type(exc).__name__])[0]  # torch may raise it with no message
    return UserError(key, f"out of memory ({where}; batch {b} per process, {cfg.train.precision}): {first_line}",
                     "; ".join(hints))


def _stuck_for_test() -> None:
    """debug.hang_at_step: what a rank stuck outside any collective looks like (a dead file system, a deadlock)."""
    while True:
        time.sleep(1)


def _progress_bar(env: DistEnv, total: int, initial: int) -> Any:
    """A tqdm bar on rank 0 when stderr is a terminal; batch logs get plain lines instead."""
    if not env.is_main or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def fit(cfg: Config, env: DistEnv, device: torch.device) -> dict[str, Any]:
    """Train to the configured epochs or until preempted; return the run's summary."""
    preempt_signal = getattr(signal, cfg.checkpoint.signal)
    signals = tuple({preempt_signal, signal.SIGTERM})
    preemption = Preemption(signals)
    try:
        return Trainer(cfg, env, device, preemption, signals).fit()
    finally:
        preemption.restore()
