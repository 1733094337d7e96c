"""No hidden host-device synchronisation in the training step: the loss and counters stay on the device until a log.

On a GPU, reading a tensor's value (``.item()``, ``float``, ``bool``) waits for every queued kernel, which a bare loop
never does. The built-in trainer's optimizer steps, DDP across 2 real processes with gradient accumulation and
clipping, must read none; a task that reads its loss each micro-step shows that the count sees them.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from .conftest import ROOT, SMALL, ok, run_trainer

CHATTY = '''
import torch.nn.functional as F


class Chatty:
    """The built-in task, plus the habit this test is about: reading the loss on every micro-step."""

    def training_step(self, model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        if loss.item() > 1e9:
            raise RuntimeError("diverged")
        return loss

    def eval_step(self, model, batch):
        x, y = batch
        out = model(x)
        return {"loss": (F.cross_entropy(out, y, reduction="sum"), y.numel())}
'''


@pytest.mark.parametrize("task, reads_per_window", [("", 0), ("userpkg_reads:Chatty", 2)])
def test_training_steps_never_read_device_values(tmp_path: Path, task: str, reads_per_window: int) -> None:
    (tmp_path / "userpkg_reads.py").write_text(textwrap.dedent(CHATTY))
    args = [*SMALL, "data.synthetic_train_size=512", "data.batch_size=16", "optim.grad_accum=2", "optim.grad_clip=1.0",
            "train.log_every=4", "checkpoint.poll_steps=3", "checkpoint.every_steps=5", f"run.dir={tmp_path / 'run'}"]
    if task:
        args.append(f"task.target={task}")
    proc = ok(run_trainer(args, tmp_path, nproc=2, env={"PYTHONPATH": f"{tmp_path}:{ROOT}"},
                          script=ROOT / "tests" / "scripts" / "count_reads.py"))
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["windows"] == 512 // (2 * 16 * 2)  # every optimizer step was counted: 2 ranks, batch 16, accum 2
    assert counts["reads"] == reads_per_window * counts["windows"], counts


class _Queued:
    """A window's loss still being computed: reading its value waits ``wait`` seconds of the injected clock."""

    def __init__(self, now: list[float], wait: float) -> None:
        self.now, self.wait = now, wait

    def __float__(self) -> float:
        self.now[0] += self.wait
        return 2.0


def test_the_logged_rate_counts_the_wait_for_the_device_to_finish_the_window() -> None:
    """The host only queues a window's steps; its samples/s ends when their loss can be read, not when queued."""
    from trainer.builtin.metrics import Meter

    now = [100.0]
    meter = Meter(clock=lambda: now[0])
    meter.sums["loss"], meter.n, meter.samples, meter.steps = _Queued(now, 1.0), 1, 320, 20  # type: ignore[assignment]
    now[0] += 3.0  # the host queued 20 steps in 3 s; the device needs 1 s more
    m = meter.metrics(lr=0.1)
    assert m["train/samples_per_s"] == 80.0 and m["train/step_time_s"] == 0.2 and m["train/loss"] == 2.0
