"""The training loop: DDP, accumulation, AMP, evaluation, periodic and preemption checkpoints."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
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
from trainer.env import DistEnv
from trainer.errors import EXIT_REQUEUE
from trainer.models import build_model


class Preemption:
    """Sets a flag when a preemption signal arrives; the loop acts on it at the next step boundary."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signum = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def restore(self) -> None:
        """Put back the handlers that were there before (e.g. submitit's)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum  # no I/O in a handler: it may interrupt a write


def say(env: DistEnv, msg: str) -> None:
    """Print from rank 0 only; everything a user reads goes through here."""
    if env.is_main:
        print(msg, flush=True)


def choose_run_dir(cfg: Config, env: DistEnv) -> Path:
    """The run folder, decided on rank 0 and shared: a requeued Slurm job finds its own folder again."""
    if cfg.run.dir:
        return Path(cfg.run.dir).resolve()
    choice: list[Any] = [None]
    if env.is_main:
        name = env.job_id if env.job_id else datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs", name).resolve()
        if not env.job_id and path.exists():
            path = Path(f"{path}-{time.time_ns() % 10**6}")
        choice[0] = str(path)
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


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


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, device: torch.device, autocast: Any) -> tuple[float, float]:
    """Loss and accuracy over the whole test set, each rank scoring its shard, summed across ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            out = model(x)
        totals[0] += F.cross_entropy(out.float(), y, reduction="sum").item()
        totals[1] += (out.argmax(1) == y).sum().item()
        totals[2] += y.numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


class Meter:
    """Loss and throughput since the last report (rank 0's view)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss, self.n, self.samples, self.t0 = 0.0, 0, 0, time.perf_counter()

    def add(self, loss: float, samples: int) -> None:
        self.loss += loss
        self.n += 1
        self.samples += samples

    def rate(self) -> float:
        return self.samples / max(1e-9, time.perf_counter() - self.t0)


def fit(cfg: Config, env: DistEnv, device: torch.device) -> dict[str, Any]:
    """Train to the configured epochs or until preempted; return the run's summary."""
    preempt_signal = getattr(signal, cfg.checkpoint.signal)
    signals = tuple({preempt_signal, signal.SIGTERM})
    preemption = Preemption(signals)
    try:
        return _fit(cfg, env, device, preemption, preempt_signal, signals)
    finally:
        preemption.restore()


def _fit(cfg: Config, env: DistEnv, device: torch.device, preemption: Preemption, preempt_signal: int,
         signals: tuple[int, ...]) -> dict[str, Any]:
    torch.manual_seed(cfg.train.seed)
    torch.use_deterministic_algorithms(cfg.train.deterministic)

    data = build_data(cfg)  # before the run folder exists: a missing data set must leave nothing behind
    run_dir = choose_run_dir(cfg, env)
    requeue_marker = run_dir / "requeue.json"
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_atomic(run_dir / "config.yaml", to_yaml(cfg).encode())
        requeue_marker.unlink(missing_ok=True)
    checkpointer = ckpt.Checkpointer(run_dir / "checkpoints", env.is_main, cfg.checkpoint.keep, cfg.debug.save_delay_s)
    train_loader, sampler, test_loader = loaders(data, cfg, env, device, signals)
    model = build_model(cfg.model, data.in_channels, data.image_size).to(device)
    params = model.parameters()
    optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=cfg.optim.lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
        if cfg.optim.name == "sgd"
        else torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    )
    accum = cfg.optim.grad_accum
    steps_per_epoch = math.ceil(len(train_loader) / accum)
    total_steps = steps_per_epoch * cfg.train.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps))
    scaler = torch.amp.GradScaler(enabled=cfg.train.precision == "fp16")
    progress = ckpt.Progress()

    resumed_from = resume(cfg, env, run_dir, model, optimizer, scheduler, scaler, progress)
    saved: tuple[int, Path] | None = (progress.global_step, resumed_from) if resumed_from else None
    if resumed_from:
        say(env, f"resumed from {resumed_from} at epoch {progress.epoch}, step {progress.global_step}")

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    net: nn.Module = torch.compile(ddp) if cfg.train.compile else ddp  # type: ignore[assignment]
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=amp_dtype)

    def state() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
            "progress": asdict(progress),
            "world_size": env.world_size,
            "tracking": {"run_id": None},
            "version": ckpt.FORMAT_VERSION,
        }

    global_batch = cfg.data.batch_size * env.world_size * accum
    say(env, f"run {run_dir} | {env.world_size} process(es) via {env.source} on {device.type} | "
             f"{cfg.model.name} on {cfg.data.name} | global batch {global_batch} | {total_steps} steps")
    meter = Meter()
    bar = _progress_bar(env, total_steps, progress.global_step)
    last_save_time = time.monotonic()
    micro = 0  # micro-batches seen by this process in this run (for the test hook)
    outcome = "finished"
    scores: tuple[float, float] | None = None  # test loss and accuracy after the last finished epoch
    model.train()
    while progress.epoch < cfg.train.epochs and outcome == "finished":
        sampler.start_epoch(progress.epoch, progress.batches_in_epoch * cfg.data.batch_size)
        batches = iter(train_loader)
        n_batches = len(train_loader) + progress.batches_in_epoch
        while progress.batches_in_epoch < n_batches:
            window = min(accum, n_batches - progress.batches_in_epoch)
            for i, (x, y) in enumerate(_take(batches, window)):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                # Gradients are all-reduced only on the window's last micro-batch.
                sync = contextlib.nullcontext() if i == window - 1 else ddp.no_sync()
                with sync, autocast():
                    loss = F.cross_entropy(net(x).float(), y) / window
                scaler.scale(loss).backward()
                meter.add(loss.item() * window, x.shape[0] * env.world_size)
                micro += 1
                if micro == cfg.debug.preempt_at_step + 1:
                    preemption.signum = preempt_signal
            if cfg.optim.grad_clip > 0:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            progress.batches_in_epoch += window
            progress.global_step += 1
            if cfg.debug.step_delay_s:
                time.sleep(cfg.debug.step_delay_s)
            _report(env, bar, meter, progress, scheduler, cfg)

            # One small all-reduce per step tells every rank whether anyone was signalled and
            # whether rank 0's clock says a timed save is due, so all ranks save together.
            due_time = (cfg.checkpoint.every_minutes > 0 and env.is_main
                        and time.monotonic() - last_save_time >= 60 * cfg.checkpoint.every_minutes)
            flags = torch.tensor([preemption.signum, float(due_time)], device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            signum = int(flags[0].item())
            if progress.batches_in_epoch >= n_batches:  # a finished epoch is saved as the next one's start
                progress.epoch, progress.batches_in_epoch = progress.epoch + 1, 0
            if signum:
                path = checkpointer.save(state(), progress.global_step)
                saved = progress.global_step, path
                if env.is_main:  # for launchers that cannot see our exit code (torchrun's agent turns 75 into 1)
                    marker = {"signal": signal.Signals(signum).name, "checkpoint": str(path), "step": progress.global_step}
                    ckpt.write_atomic(requeue_marker, json.dumps(marker).encode())
                dist.barrier()  # the marker exists before any rank exits (srun may then kill the rest)
                say(env, f"\n{signal.Signals(signum).name} received: saved {path} at step {progress.global_step}; "
                         f"exiting with {EXIT_REQUEUE} so the launcher requeues")
                outcome = "preempted"
                break
            every = cfg.checkpoint.every_steps
            if (every and progress.global_step % every == 0) or flags[1].item():
                path = checkpointer.save(state(), progress.global_step, blocking=not cfg.checkpoint.async_save)
                saved = progress.global_step, path
                last_save_time = time.monotonic()
            if progress.batches_in_epoch == 0:
                break
        if outcome == "finished":
            scores = evaluate(net, test_loader, device, autocast)
            say(env, f"\nepoch {progress.epoch}/{cfg.train.epochs}: test loss {scores[0]:.4f}, "
                     f"accuracy {100 * scores[1]:.2f}%")
    checkpointer.wait()
    if bar is not None:
        bar.close()
    if outcome == "preempted":
        return {"outcome": outcome, "exit_code": EXIT_REQUEUE, "run_dir": str(run_dir), "rank": env.rank,
                "signal": signal.Signals(signum).name, "checkpoint": str(saved[1]) if saved else None}

    # The final state is saved once: not again when the last periodic save already holds it.
    final = saved[1] if saved and saved[0] == progress.global_step else checkpointer.save(state(), progress.global_step)
    test_loss, test_acc = scores or evaluate(net, test_loader, device, autocast)
    checksums: list[str | None] = [None] * env.world_size
    dist.all_gather_object(checksums, param_checksum(model))
    result = {
        "outcome": outcome,
        "exit_code": 0,
        "run_dir": str(run_dir),
        "checkpoint": str(final),
        "test_loss": test_loss,
        "test_accuracy": test_acc,
        "chance_accuracy": 1 / cfg.model.num_classes,
        "global_step": progress.global_step,
        "world_size": env.world_size,
        "param_checksums": checksums,
        "rank": env.rank,
        "resumed_from": str(resumed_from) if resumed_from else None,
    }
    if env.is_main:
        ckpt.write_atomic(run_dir / "result.json", json.dumps(result, indent=1).encode())
    say(env, f"done: test accuracy {100 * test_acc:.2f}% (chance {100 / cfg.model.num_classes:.0f}%), "
             f"checkpoint {final}")
    return result


def resume(cfg: Config, env: DistEnv, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: Any, scaler: torch.amp.GradScaler, progress: ckpt.Progress) -> Path | None:
    """Load the checkpoint ``checkpoint.resume`` points to into the (unwrapped) model and friends."""
    if cfg.checkpoint.resume == "never":
        return None
    target = run_dir if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)
    # Rank 0 picks (and verifies) the checkpoint, so warnings appear once and all ranks load the same one.
    chosen: list[Any] = [None]
    if env.is_main:
        found = ckpt.find_resumable(target)
        chosen[0] = str(found[0]) if found else None
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    path = Path(chosen[0])
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    for k, v in state["progress"].items():
        setattr(progress, k, v)
    saved_cfg = state["config"]
    for group, key in (("data", "name"), ("data", "batch_size"), ("optim", "grad_accum"), ("train", "seed")):
        if saved_cfg[group][key] != getattr(getattr(cfg, group), key):
            say(env, f"note: {group}.{key} was {saved_cfg[group][key]!r} in the checkpoint, now "
                     f"{getattr(getattr(cfg, group), key)!r}: training continues, but not as the original run would")
    if state["world_size"] == env.world_size:
        ckpt.set_rng_state(state["rng"][env.rank])
    else:
        say(env, f"note: checkpoint was written by {state['world_size']} processes, now {env.world_size}: "
                 "random generators are re-seeded, so the data order continues but is not bit-exact")
    return path


def _take(it: Iterator[Any], n: int) -> Iterator[Any]:
    for _ in range(n):
        yield next(it)


def _progress_bar(env: DistEnv, total: int, initial: int) -> Any:
    """A tqdm bar on rank 0 when stderr is a terminal; batch logs get plain lines instead."""
    if not env.is_main or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def _report(env: DistEnv, bar: Any, meter: Meter, progress: ckpt.Progress, scheduler: Any, cfg: Config) -> None:
    if not env.is_main:
        return
    if bar is not None:
        bar.update(1)
        if progress.global_step % 10 == 0:
            bar.set_postfix(loss=f"{meter.loss / max(1, meter.n):.4f}", samples_s=f"{meter.rate():.0f}")
            meter.reset()
    elif progress.global_step % cfg.train.log_every == 0:
        print(f"epoch {progress.epoch} step {progress.global_step}: loss {meter.loss / max(1, meter.n):.4f}, "
              f"{meter.rate():.0f} samples/s, lr {scheduler.get_last_lr()[0]:.4g}", flush=True)
        meter.reset()
