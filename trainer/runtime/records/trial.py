"""Intermediate values and pruning, for a run that is a sweep's trial (and harmless for one that is not).

The file protocol, which a command that does not use the session can follow too:
- ``reports.jsonl`` in the run folder: one line per report, ``{"step": 100, "value": 1.23}`` or
  ``{"step": 100, "values": {"test_loss": 1.23, …}}`` (the sweep picks its metric), appended by rank 0;
- ``pruning.json``: ``{"step": 100, "prune": false}``, the pruner's answer for the last step the sweep's worker
  relayed into the study. A trial asked to prune ends cleanly; its result.json says ``"outcome": "pruned"``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.core.dist import host_group, say
from trainer.core.env import DistEnv

REPORTS, PRUNING = "reports.jsonl", "pruning.json"
"""The run folder's files of the protocol above."""

ANSWER_WAIT_S = 60.0
"""How long rank 0 waits for the pruner's answer to the last report before training on without it."""


class Reports:
    """One run's reported values and the pruning decisions agreed across ranks."""

    def __init__(self, run_dir: Path, env: DistEnv, pruning: bool) -> None:
        self.run_dir, self.env, self.pruning = run_dir, env, pruning
        self.last_step: int | None = None
        self.pruned = False
        """A pruning was agreed: the run ends early, and ``finish`` records it as pruned."""

    def report(self, step: int, value: float | Mapping[str, float]) -> None:
        """Record ``value`` (the sweep's metric, or several metrics by name) at ``step``; rank 0 writes it."""
        self.last_step = step
        if not self.env.is_main:
            return
        row = ({"step": step, "values": {k: float(v) for k, v in value.items()}} if isinstance(value, Mapping)
               else {"step": step, "value": float(value)})
        with open(self.run_dir / REPORTS, "a") as f:
            f.write(json.dumps(row) + "\n")

    def should_prune(self) -> bool:
        """Collective (every rank, after the same ``report``): whether the sweep's pruner stops this trial now.
        False outside a sweep with a pruner, and before the first report."""
        if not self.pruning or self.last_step is None:
            return False
        flag = torch.tensor([int(self._answer(self.last_step)) if self.env.is_main else 0], dtype=torch.int32)
        if self.env.world_size > 1:  # on the host, as the other flags (trainer/runtime/poll.py)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
        self.pruned = self.pruned or bool(flag.item())
        return bool(flag.item())

    def _answer(self, step: int) -> bool:
        """Rank 0: the worker's answer for ``step`` (or a later one), waited for up to ANSWER_WAIT_S."""
        deadline = time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < deadline:
            try:
                answer = json.loads((self.run_dir / PRUNING).read_text())
                if isinstance(answer.get("step"), int) and answer["step"] >= step:
                    return bool(answer.get("prune"))
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        say(self.env, f"note: no pruning answer for step {step} within {ANSWER_WAIT_S:.0f} s (the sweep's worker "
                      "relays it); training goes on")
        return False

