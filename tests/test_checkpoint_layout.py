"""The checkpoint folder's pruning (trainer/checkpoint/layout.py) when a run went back to an older checkpoint: the
save it just published is the one it continues from, whatever newer names lie beside it."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.checkpoint import layout

from .conftest import SMALL, faults, ok, result_of, run_trainer


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def commit(folder: Path, step: int, keep: int) -> Path:
    """A single-file checkpoint of ``step`` committed as the checkpointer commits it (bytes, then publish)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{layout.PREFIX}{step:08d}.pt"
    final.write_bytes(b"state %d" % step)
    layout.publish(folder, final, step, keep, file=final.name, size=final.stat().st_size, xxh3_64="-")
    return final


def test_a_save_is_never_pruned_in_favour_of_newer_checkpoints_the_run_went_back_from(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    for step in (10, 20, 90):  # 90: the damaged newest one the run restarted before
        commit(folder, step, keep=5)
    saved = commit(folder, 30, keep=1)
    assert saved.is_file() and (folder / "latest").read_text() == saved.name
    assert sorted(p.name for p in folder.iterdir() if p.name != "latest") == [
        "step_00000030.json", "step_00000030.pt", "step_00000090.json", "step_00000090.pt"]
    commit(folder, 40, keep=2)
    assert [m.stem for m in layout.committed(folder)] == ["step_00000090", "step_00000040", "step_00000030"]
    commit(folder, 95, keep=2)  # past the old one again: the ranking is by step as before
    assert [m.stem for m in layout.committed(folder)] == ["step_00000095", "step_00000090"]


def test_a_run_that_resumed_before_damaged_checkpoints_keeps_its_saves_with_keep_1(tmp_path: Path) -> None:
    """Steps 30 and 32 fail verification, so the run resumes from 20; with checkpoint.keep=1 each save it makes must
    survive its own prune (none did: the newest name, damaged, was kept and the new save deleted), and the requeued
    run resume from its preemption save."""
    run = tmp_path / "run"
    args = [*SMALL, f"run.dir={run}", "checkpoint.every_steps=10"]
    ok(run_trainer([*args, "checkpoint.keep=5"], tmp_path))
    for step in (30, 32):
        damage(run / "checkpoints" / f"step_{step:08d}.pt")
    ok(run_trainer([*args, "checkpoint.keep=1"], tmp_path, env=faults(preempt_at_step=3)), code=75)
    saved = Path(json.loads((run / "requeue.json").read_text())["checkpoint"])
    assert saved.is_file(), f"the preemption save {saved.name} was pruned at once"
    assert json.loads(saved.with_suffix(".json").read_text())["global_step"] > 20
    resumed = ok(run_trainer([*args, "checkpoint.keep=1"], tmp_path))
    assert f"resumed from {saved}" in resumed.stdout, resumed.stdout
    assert result_of(run)["global_step"] == 32
    assert [m.stem for m in layout.committed(run / "checkpoints")] == ["step_00000032"]
