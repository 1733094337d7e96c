"""The built-in training loop, written on the public Session API like any user's loop: the configured (or the
user's) model, data and task, with gradient accumulation, AMP, evaluation, progress output and tracking."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from trainer.builtin.build import Parts, build_parts
from trainer.builtin.metrics import Meter, progress_bar, reduce_sums
from trainer.builtin.oom import out_of_memory
from trainer.builtin.task import batch_size, split_output, to_device
from trainer.core.dist import gather, say
from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.core.schema import Config
from trainer.data.loader import InMemory
from trainer.runtime.session import PerRank, Session


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
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # an evaluation's forward leaves the root's parameters gathered (bf16 ones too)
        if isinstance(module, FSDPModule):
            module.reshard()
    h = hashlib.sha256()
    for p in model.parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # a sharded parameter: gathered (collective)
        # A copy: numpy() on the tensor itself would pin its storage, which FSDP frees and regrows. Bytes of any dtype.
        h.update(whole.detach().cpu().contiguous().clone().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _workers(cfg: Config, sess: Session, in_process: bool) -> int:
    """data.num_workers, or auto: worker processes only pay off when there is decoding or augmentation to do."""
    if cfg.data.num_workers >= 0:
        return cfg.data.num_workers
    per_process = max(1, (os.cpu_count() or 1) // sess.env.local_world_size)
    return 0 if in_process else min(4, max(1, per_process - 1))


class Trainer:
    """One process's share of a run of the built-in loop on a session: built here (no I/O), then ``restore``, ``fit``."""

    def __init__(self, sess: Session, parts: Parts) -> None:
        cfg, self.sess, self.cfg = sess.cfg, sess, sess.cfg
        self.task, self.record, self.data = parts.task, parts.record, parts.data
        if cfg.train.precision == "fp16" and sess.device.type != "cuda":  # train.device=auto found no GPU
            raise UserError("train.precision", f"fp16 needs CUDA (GradScaler), and this run's device is {sess.device}",
                            "use train.precision=bf16 or fp32 without a GPU")
        data = self.data
        # In-memory sets need no workers; iterable sets load in-process, so that a Stateful set's position is the
        # loader's (workers would hold copies).
        kw = {"num_workers": _workers(cfg, sess, isinstance(data.train, InMemory) or data.iterable)}
        self.loader = sess.loader(data.train, cfg.data.batch_size, cfg.data.global_batch_size or None,
                                  cfg.optim.grad_accum, **kw)
        self.eval_loader = None if data.test is None else sess.eval_loader(data.test, cfg.data.batch_size, **kw)
        self.net = sess.wrap(parts.model)  # the optimizer holds the same parameters as the unwrapped model
        self.model: nn.Module = parts.model  # under fsdp the same module as self.net
        o = cfg.optim
        # One kernel for all parameters on CUDA (the CPU keeps foreach); sharded parameters have a fused AdamW only.
        fused = True if sess.device.type == "cuda" and (o.name == "adamw" or not cfg.dist.sharded) else None
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(self.model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                            fused=fused)
            if o.name == "sgd" else
            torch.optim.AdamW(self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay, fused=fused))
        self._plan_steps()
        # The schedule reads total_steps when it steps: a global batch kept from the first attempt is known at restore.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: lr_factor(cfg, self.total_steps)(step))
        self.scaler = torch.amp.GradScaler(enabled=cfg.train.precision == "fp16")
        self.in_process = kw["num_workers"] == 0
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    def _plan_steps(self) -> None:
        """Micro-batches per step and steps in all, from the loader's plan (again after restore: it may change)."""
        cfg = self.cfg
        self.accumulation = self.loader.accumulation
        if self.data.iterable:  # no length: train.max_steps (required) decides
            self.total_steps = cfg.train.max_steps
        else:  # the steps done, then the rest of the epochs in this world size's steps (a resume may change them)
            loader, epochs = self.loader, cfg.train.epochs
            left = -(-loader.remaining() // self.accumulation) + (epochs - loader.epoch - 1) * loader.epoch_steps
            self.total_steps = self.sess.step + left if loader.epoch < epochs else self.sess.step
            self.total_steps = min(self.total_steps, cfg.train.max_steps or self.total_steps)

    def restore(self) -> None:
        """Open the run folder and continue from its newest checkpoint, if any; then compile (when asked)."""
        sess, cfg, data = self.sess, self.cfg, self.data
        # An iterable set's own state is its position only when the training process reads it (workers hold copies).
        stateful = callable(getattr(data.train, "state_dict", None)) and callable(getattr(data.train, "load_state_dict", None))
        extra = {"data": PerRank(data.train)} if data.iterable and stateful and self.in_process else {}
        sess.restore(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                     loader=self.loader, **extra)
        self._plan_steps()
        if sess.resumed:
            notes(cfg, sess.env, sess.resumed.state, self.record)
        if cfg.train.compile:
            # Static shapes: the batches have one shape but the last of an epoch, and by default that one would make
            # torch recompile the model for any batch size, so that every later step ran kernels made for symbolic
            # sizes (benchmarks section 4's +short row). It gets a graph of its own instead.
            self.net = torch.compile(self.net, mode=cfg.train.compile_mode, dynamic=False)  # type: ignore[assignment]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.sess.device.type, dtype=self.amp_dtype)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's metrics over the whole evaluation set, each rank scoring its shard, summed across ranks."""
        if self.eval_loader is None:
            return {}
        # The unwrapped model: a DDP forward broadcasts buffers, a collective that ranks with one batch
        # fewer (shards differ by up to one sample) would never join. A sharded model gathers its parameters in
        # every forward: eval_batches gives every rank as many (the extra ones do not count).
        self.model.eval()
        sums: dict[str, list[Any]] = {}
        for batch, counts in self.sess.eval_batches(self.eval_loader):
            self.sess.alive()  # shards differ by a batch: not a lockstep beat
            with self.autocast():
                out = self.task.eval_step(self.model, to_device(batch, self.sess.device))
            if not counts:
                continue
            for name, (s, n) in out.items():
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + s, acc[1] + n
        self.sess.beat("evaluation all-reduce")
        scores = reduce_sums({k: [float(s), float(n)] for k, (s, n) in sums.items()})
        self.model.train()
        return scores

    def train_window(self, batches: Iterator[Any], window: int) -> None:
        """One optimizer step over ``window`` micro-batches; gradients are all-reduced on the last one only."""
        sess = self.sess
        for i in range(window):
            sess.beat("data loading")
            batch = to_device(next(batches), sess.device)
            sync = sess.no_sync(self.net, skip=i < window - 1)
            sess.beat("forward")
            with sync, self.autocast():
                out = self.task.training_step(self.net, batch)
            try:
                loss, extra = split_output(out)
            except TypeError as exc:
                raise UserError("task.target", str(exc), "return the mean loss tensor of the micro-batch") from None
            sess.beat("backward (gradient all-reduce)" if i == window - 1 else "backward")
            self.scaler.scale(loss / window).backward()
            n = batch_size(batch) * sess.env.world_size
            self.meter.add(loss, extra, n)
            self.samples_seen += n
        sess.beat("optimizer step")
        if self.cfg.optim.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.meter.steps += 1

    def fit(self) -> int:
        """Train to the configured epochs (or train.max_steps) or until preempted; return the exit code."""
        sess, cfg = self.sess, self.cfg
        try:
            return self._fit()
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(exc, cfg, sess.env, sess.device, sess.step, self.loader.epoch,
                                batch=self.loader.batch_size) from None

    def _fit(self) -> int:
        sess, env = self.sess, self.sess.env
        global_batch = self.loader.batch_size * env.world_size * self.accumulation
        sess.print(f"run {sess.run_dir} | {env.world_size} process(es) via {env.source} on {sess.device.type} | "
                   f"{self.record['model']['target']} on {self.record['data']['target']} | global batch {global_batch} "
                   f"| {self.total_steps} steps")
        self.meter, self.samples_seen = Meter(), 0
        bar = progress_bar(env, self.total_steps, sess.step)
        started, self.eval_time = time.perf_counter(), 0.0
        self.first_step_at: float | None = None
        """Wall-clock time.time() as the first optimizer step ended."""
        self.scores: dict[str, float] = {}
        self.scored_at = -1
        batches = self.loader.forever()
        self.net.train()
        start = sess.step
        while True:
            try:
                self._steps(start, batches, bar)
                break
            except RuntimeError as exc:  # a lost peer: the survivors go on in place (TRAINER_STORE), else raised
                start = sess.regroup(exc)
                self._plan_steps()  # the global batch's split on the new world size, and the steps left in it
                if bar is not None:  # the steps left, as planned again, from the step the group goes on from
                    bar.total, bar.n = self.total_steps, start
                    bar.refresh()
        self.settle()
        train_time = time.perf_counter() - started - self.eval_time
        if bar is not None:
            bar.close()
        if sess.preempted:
            return sess.finish()
        if any(gather(self.scored_at != sess.step)):  # agreed: a warm spare that joined at the last step has no scores
            self.scores = self.evaluate()
            self.log_scores(self.scores, sess.step)
        code = sess.finish(self.result(self.scores, train_time, self.first_step_at))
        sess.print(f"done: {self.summary(self.scores)}; checkpoint {sess.last_path}")
        return code

    def _steps(self, start: int, batches: Iterator[Any], bar: Any) -> None:
        """Steps after ``start`` until the last, a preemption or the sweep's pruner."""
        sess, cfg = self.sess, self.cfg
        for step in sess.steps(start, self.last_step()):
            epoch = self.loader.epoch
            self.train_window(batches, min(self.accumulation, self.loader.remaining()))
            if self.first_step_at is None:
                self.first_step_at = time.time()
            self.report(bar, step)
            epoch_done = self.loader.epoch != epoch  # evaluated before any save, and saved as the next epoch's start
            every = cfg.train.eval_every
            if (every and step % every == 0) or (epoch_done and not every and not self.loader.iterable):
                self.settle()  # the queued training steps are training's time, not the evaluation's
                t_eval = time.perf_counter()
                self.scores, self.scored_at = self.evaluate(), step
                self.eval_time += time.perf_counter() - t_eval
                self.log_scores(self.scores, step)
                sess.report(step, {f"test_{k}": v for k, v in self.scores.items()})  # a sweep's pruner judges these
                if sess.should_prune():
                    sess.print(f"pruned by the sweep at step {step}: the trial ends here")
                    return
            # Iterable sets end their epochs rank by rank: only map-style epoch ends are common to all ranks.
            if sess.should_save(step, force_poll=epoch_done and not self.loader.iterable):
                sess.save(step)
                if sess.preempted:
                    return
            if not self.loader.iterable and self.loader.epoch >= cfg.train.epochs:
                return

    def settle(self) -> None:
        """Wait for the steps the host queued on a GPU (a time taken after it counts them)."""
        if self.sess.device.type == "cuda":
            torch.cuda.synchronize(self.sess.device)

    def last_step(self) -> int:
        """The step to train to: none further when the resumed run had finished its epochs (on any world size)."""
        if self.sess.resumed and not self.loader.iterable and self.loader.epoch >= self.cfg.train.epochs:
            self.sess.print(f"the run finished its {self.cfg.train.epochs} epoch(s) at step {self.sess.step}: "
                            "no step to train")
            return self.sess.step
        return self.total_steps

    def result(self, scores: dict[str, float], train_time: float, first_step_at: float | None) -> dict[str, Any]:
        """What result.json holds besides the session's own fields."""
        cfg = self.cfg
        result: dict[str, Any] = {
            **{f"test_{k}": v for k, v in scores.items()},
            "train_time_s": train_time,  # the training loop alone: evaluation excluded, this process's start-up too
            "train_samples_per_s": self.samples_seen / max(1e-9, train_time),
            "first_step_at": first_step_at,  # wall-clock time.time() when the first optimizer step ended
            "plugins": self.record,
        }
        if not cfg.task.target:
            result["chance_accuracy"] = 1 / cfg.model.num_classes
        if self.sess.job.checksum:  # a full copy of the model to the CPU on every rank: opt-in (TRAINER_CHECKSUM=1)
            result["param_checksums"] = gather(param_checksum(self.model))
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

    def log_scores(self, scores: dict[str, float], step: int) -> None:
        self.sess.log({**{f"eval/{k}": v for k, v in scores.items()}, "epoch": self.loader.epoch}, step, console=False)
        if scores:
            self.sess.print(f"\nstep {step} (epoch {self.loader.epoch}): "
                            + ", ".join(f"eval {k} {v:.4f}" for k, v in scores.items()))

    def report(self, bar: Any, step: int) -> None:
        """Progress bar or log line, and tracking, from rank 0 (the only place training metrics leave the device)."""
        if not self.sess.is_main:
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
            print(f"epoch {self.loader.epoch} step {step}: loss {m['train/loss']:.4f}, "
                  f"{m['train/samples_per_s']:.0f} samples/s, lr {m['train/lr']:.4g}", flush=True)
        self.sess.log(m, step, console=False)


def fit(cfg: Config) -> dict[str, Any]:
    """Open a session, train, close it; return this rank's summary (``exit_code``: 0 done, 75 saved for requeue)."""
    if cfg.train.deterministic and cfg.train.device != "cpu" and torch.cuda.is_available():
        # cuBLAS is deterministic only with a fixed workspace, read when its handle is made (first matmul,
        # still ahead); without it torch raises from inside the first linear layer.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if cfg.train.deterministic != torch.are_deterministic_algorithms_enabled():
        # Only when it changes something: the call imports torch._inductor (1-3 s of every process's start-up).
        torch.use_deterministic_algorithms(cfg.train.deterministic)
    with Session(cfg) as sess:
        try:
            parts = build_parts(cfg)  # the user's code runs before the run folder exists: a bad plugin leaves nothing
            sess.describe(plugins=parts.record)
            run = Trainer(sess, parts)
            run.restore()
            code = run.fit()
        except torch.OutOfMemoryError as exc:  # the model to the device, a resumed checkpoint, DDP's broadcast
            raise out_of_memory(exc, cfg, sess.env, sess.device, sess.step, setup=True) from None
        torch.distributed.barrier()  # no rank tears down while another is still in a collective (gloo may abort then)
        if code == 0:
            return {**sess.summary, "rank": sess.env.rank}
        return {"outcome": "preempted", "exit_code": code, "rank": sess.env.rank, "run_dir": str(sess.run_dir),
                "signal": sess.preempted_by.name if sess.preempted_by else "deadline", "checkpoint": str(sess.last_path)}


def notes(cfg: Config, env: DistEnv, state: dict[str, Any], record: dict[str, Any]) -> None:
    """Say what differs from the run that wrote the checkpoint: training goes on, but not as it would have."""
    # With a global batch, the micro-batch and the accumulation are how this world size splits it, not a change.
    keys = [("data", "name"), ("data", "global_batch_size"), ("train", "seed")]
    if not cfg.data.global_batch_size:
        keys[1:1] = [("data", "batch_size"), ("optim", "grad_accum")]
    for group, key in keys:
        was, now = state["config"][group].get(key, 0), getattr(getattr(cfg, group), key)
        if was != now:
            say(env, f"note: {group}.{key} was {was!r} in the checkpoint, now {now!r}: training continues, "
                     "but not as the original run would")
    for group, now in record.items():
        was = state.get("meta", {}).get("plugins", {}).get(group)
        if was and (was["target"], was["kwargs"]) != (now["target"], now["kwargs"]):
            say(env, f"note: {group} was {was['target']} {was['kwargs']} in the checkpoint, now {now['target']} "
                     f"{now['kwargs']}")
