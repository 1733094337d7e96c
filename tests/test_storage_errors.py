"""A full or failing file system under a save is named as such (trainer/core/exits.py: ``storage_error``), never as the
user's error, and leaves no half-written file behind. The disk is filled from outside: a small tmpfs mounted where the
checkpoints go."""

from __future__ import annotations

import errno
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from trainer.core import exits

from .conftest import SMALL, run_trainer, small_tmpfs


def _behind(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised while handling ``inner``, as torch.save raises its RuntimeError over the writer's OSError."""
    outer.__context__ = inner
    return outer


FULL = OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_00000005.pt")
NO_TRACE = traceback.StackSummary()


@pytest.mark.parametrize(("exc", "kind", "cause"), [
    (FULL, "resource", "no room to write: No space left on device: /ckpt/step_00000005.pt"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "resource", "no room to write: Disk quota exceeded"),
    # torch.save over a file object: an empty enforce message, the OSError only in the context
    (_behind(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), FULL), "resource",
     "no room to write: No space left on device: /ckpt/step_00000005.pt"),
    # torch.distributed.checkpoint: each rank's failure inside one BaseException
    (CheckpointException("save failed", {1: (FULL, NO_TRACE)}), "resource", "no room to write: No space left"),
    (OSError(errno.EIO, "Input/output error", "/ckpt"), "infrastructure", "storage failed: Input/output error: /ckpt"),
    (OSError(errno.EROFS, "Read-only file system"), "infrastructure", "storage failed: Read-only file system"),
    (OSError(errno.ENOENT, "No such file or directory", "/data/x"), "user_error", "FileNotFoundError: "),
    (CheckpointException("save failed", {0: (ValueError("bad key"), NO_TRACE)}), "user_error", "CheckpointException"),
])
def test_storage_errors_are_classed_by_their_errno(exc: BaseException, kind: str, cause: str) -> None:
    info = exits.classify(exc)
    assert (info["class"], info["cause"][:len(cause)]) == (kind, cause), info
    assert info.get("blame") == ([] if kind == "infrastructure" else None), info  # a shared file system: no node


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/run/checkpoints`` on a 16 KiB tmpfs: room for a manifest, not for a checkpoint."""
    with small_tmpfs(tmp_path / "run" / "checkpoints", "16k") as folder:
        yield folder


@pytest.mark.parametrize(("fmt", "background"), [("file", False), ("dcp", False), ("dcp", True)])
def test_a_checkpoint_that_fills_the_disk_is_a_resource_not_the_users_error(tmp_path: Path, small_disk: Path,
                                                                             fmt: str, background: bool) -> None:
    """Two ranks: rank 0's record names the full disk and the file; rank 1's, which only heard of it, is an echo;
    the verdict says resource whichever record was written first. A save in the background fails the same way once
    the next save or the run's end waits for it, on every rank (rank 0 alone commits)."""
    from cluster.job.judge import judge
    from trainer.core.records import exit_records

    run = tmp_path / "run"
    proc = run_trainer([*SMALL, f"run.dir={run}", "checkpoint.every_steps=5", "checkpoint.memory=off",
                        f"checkpoint.format={fmt}", f"checkpoint.async_save={str(background).lower()}",
                        "dist.timeout_s=60"], tmp_path, nproc=2, env={"RUN_DIR": str(run)})
    assert proc.returncode != 0, proc.stdout
    (folder,) = (run / "exits").iterdir()
    records = {r.rank: r for r in exit_records(folder)}
    assert records[0].kind == "resource" and not records[0].echo, records
    assert records[0].cause.startswith("no room to write: No space left on device: "), records
    if fmt == "file" and not background:  # rank 0 alone writes, and its error names the file
        assert records[0].cause.endswith(str(small_disk / "step_00000005.pt")), records
    assert records[1].kind == "resource" and (records[1].echo or fmt == "dcp"), records
    verdict = judge(list(records.values()), [], 1, None)
    assert verdict.kind == "resource" and "no room to write" in verdict.cause, verdict
    assert list(small_disk.iterdir()) == []  # nothing half-written: it held the room a retry needs


def test_a_final_save_in_the_background_that_fails_never_reports_the_run_finished(tmp_path: Path,
                                                                                  small_disk: Path) -> None:
    """checkpoint.async_save: the run's end saves blocking, so result.json never says "finished" (pointing at a
    checkpoint) before that checkpoint is committed; the full disk ends the run as a resource error."""
    run = tmp_path / "run"
    proc = run_trainer([*SMALL, f"run.dir={run}", "checkpoint.every_steps=100000", "checkpoint.memory=off",
                        "checkpoint.async_save=true"], tmp_path, nproc=2, env={"RUN_DIR": str(run)})
    assert proc.returncode != 0, proc.stdout
    assert not (run / "result.json").exists(), (run / "result.json").read_text()
