"""Memory snapshots (checkpoint.memory): taken between durable saves, restored after an unannounced kill from the
memory of the nodes of the next attempt, with real gloo processes. Ranks run as if on separate nodes
(SLURMD_NODENAME), each node's memory a folder of its own under TRAINER_MEMORY_DIR, and a node only reads its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.export import consolidated

from .conftest import ROOT, SMALL, faults, ok, result_of, run_trainer, small_tmpfs, spawn_ranks, wait_ranks

# 32 steps on 2 processes; durable saves every 10 steps, snapshots every 3.
ARGS = [*SMALL, "train.epochs=2", "checkpoint.every_steps=10", "checkpoint.memory=on",
        "checkpoint.memory_every_steps=3", "checkpoint.poll_steps=1", "train.deterministic=true"]
CHAR_LM = ROOT / "examples" / "char_lm" / "train.py"
LM = ["--max-steps", "24", "--eval-every", "100", "--max-bytes", "60000", "--batch-size", "8", "--sample", "0",
      "tracking.mode=disabled", "checkpoint.every_steps=10", "checkpoint.memory=on", "checkpoint.memory_every_steps=3",
      "checkpoint.poll_steps=1"]


def launch(args: list[str], cwd: Path, nodes: list[str], env: dict[str, str],
           script: Path | None = None) -> subprocess.CompletedProcess[str]:
    ranks = spawn_ranks(args, cwd, len(nodes), env, script=script, split=True, nodes=nodes)
    return wait_ranks(ranks, args, 240)


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The run's final model as whole tensors, whatever the checkpoint format."""
    return consolidated(run)[1]


def attempts(run: Path) -> list[dict[str, Any]]:
    lines = (run / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "attempt"]


@pytest.mark.parametrize(("strategy", "after"), [
    ("ddp", ["n1", "n3"]),  # a spare node takes over: it holds nothing, n1 sends it the (replicated) state
    ("fsdp", ["n1", "n3"]),  # n2's shards survive only in its partner n1's memory: n1 sends them to n3
    ("fsdp", ["n1"]),  # shrink to one process: n1 holds both shards, resharded onto one
])
def test_a_killed_rank_resumes_from_node_memory_as_if_uninterrupted(tmp_path: Path, strategy: str,
                                                                    after: list[str]) -> None:
    args = [*ARGS, f"dist.strategy={strategy}", "data.global_batch_size=64"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    env = {"TRAINER_MEMORY_DIR": str(tmp_path / "shm")}
    ok(launch([*args, f"run.dir={ref}"], tmp_path, ["m1", "m2"], {"TRAINER_MEMORY_DIR": str(tmp_path / "shm-ref")}))
    killed = launch([*args, f"run.dir={run}"], tmp_path, ["n1", "n2"], {**env, **faults(kill_at_step=15)})
    assert killed.returncode != 0
    second = ok(launch([*args, f"run.dir={run}"], tmp_path, after, env))
    # Step 16 was done when rank 1 died; the newest snapshot is step 15, the newest durable checkpoint step 10.
    assert "(a snapshot in node memory) at step 15" in second.stdout, second.stdout
    start = attempts(run)[-1]
    assert (start["resumed_step"], start["restored_from"]) == (15, "memory"), start
    a, b = weights(ref), weights(run)
    if len(after) == 2:
        assert all(torch.equal(a[k], b[k]) for k in a), "weights differ from the uninterrupted run"
    else:  # another number of processes: the same samples, summed in another order
        assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    left = [f for node in after for f in (tmp_path / "shm").rglob(f"{node}/step_*")]
    assert not left, "a finished run leaves no snapshot in its nodes' memory"


def test_an_own_loop_resumes_from_node_memory_bit_identically(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    env = {"TRAINER_MEMORY_DIR": str(tmp_path / "shm")}
    ok(launch([*LM, f"run.dir={ref}"], tmp_path, ["n1", "n2"], env, CHAR_LM))
    assert launch([*LM, f"run.dir={run}"], tmp_path, ["n1", "n2"], {**env, **faults(kill_at_step=13)},
                  CHAR_LM).returncode != 0
    second = ok(launch([*LM, f"run.dir={run}"], tmp_path, ["n1", "n3"], env, CHAR_LM))
    assert "(a snapshot in node memory) at step 12" in second.stdout, second.stdout
    a, b = weights(ref), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_a_complete_snapshot_the_durable_checkpoint_is_used(tmp_path: Path) -> None:
    """Both nodes of the killed attempt are gone (a fresh pair): nothing survives in memory."""
    run, env = tmp_path / "run", {"TRAINER_MEMORY_DIR": str(tmp_path / "shm")}
    args = [*ARGS, f"run.dir={run}"]
    assert launch(args, tmp_path, ["n1", "n2"], {**env, **faults(kill_at_step=15)}).returncode != 0
    second = ok(launch(args, tmp_path, ["n3", "n4"], env))
    assert f"resumed from {run / 'checkpoints' / 'step_00000010.pt'} at step 10" in second.stdout
    assert attempts(run)[-1]["restored_from"] == "disk"


def test_memory_asked_for_without_room_is_refused_before_training(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "64k") as small:
        env = {"TRAINER_MEMORY_DIR": str(small)}
        proc = run_trainer([*ARGS, "model.name=resnet18", f"run.dir={tmp_path / 'a'}"], tmp_path, env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "error: checkpoint.memory: snapshots need about" in proc.stderr and "MiB free" in proc.stderr
        assert "HINT: " in proc.stderr and "Traceback" not in proc.stderr
        auto = ok(run_trainer([*ARGS, "checkpoint.memory=auto", f"run.dir={tmp_path / 'b'}"], tmp_path,
                              env={**env, "TRAINER_IN_PLACE": "1"}))
        assert "note: no memory snapshots" in auto.stdout or result_of(tmp_path / "b")["outcome"] == "finished"


def test_a_snapshot_that_cannot_be_written_is_a_warning_not_a_lost_run(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the snapshot folder should be")
    proc = ok(run_trainer([*ARGS, f"run.dir={tmp_path / 'run'}"], tmp_path, env={"TRAINER_MEMORY_DIR": str(blocked)}))
    assert proc.stdout.count("warning: memory snapshots stop") == 1, proc.stdout
    assert result_of(tmp_path / "run")["outcome"] == "finished"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_snapshot_that_fails_on_one_node_stops_snapshots_on_every_rank(tmp_path: Path, strategy: str) -> None:
    """Node n2's snapshot folder cannot be made (a file in its place: as /dev/shm full there), n1's can. DDP: n2's
    background write fails and only n2 learns it, at the next snapshot; FSDP: n2 fails inside the save's stages.
    Either way every rank agrees to stop snapshots and the run finishes, instead of the ranks waiting in different
    collectives until the timeout."""
    from trainer.checkpoint.memory import place
    shm, run = tmp_path / "shm", tmp_path / "run"
    node_folder = place(str(shm), None, 0, run).parent / "n2"
    node_folder.parent.mkdir(parents=True)
    node_folder.write_text("no room here")
    proc = ok(launch([*ARGS, f"dist.strategy={strategy}", "dist.timeout_s=60", f"run.dir={run}"], tmp_path,
                     ["n1", "n2"], {"TRAINER_MEMORY_DIR": str(shm)}))
    assert "warning: memory snapshots stop" in proc.stdout, proc.stdout
    assert result_of(run)["outcome"] == "finished"


@pytest.mark.parametrize("missing", [None, 1])
def test_a_partner_swap_that_fails_on_one_rank_fails_on_both_instead_of_waiting(tmp_path: Path,
                                                                                missing: int | None) -> None:
    """A sharded snapshot's swap sends each rank's shard file to its partner on the next node. With rank 1's file
    gone (removed from outside), both ranks fail the swap at once, rank 1 naming the file; before, rank 1 left for the
    stage's agreement while rank 0 waited to receive from it, until the process group's timeout."""
    for rank in (0, 1):
        (tmp_path / f"tmp-{rank}").mkdir()
        if rank != missing:
            (tmp_path / f"tmp-{rank}" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
    ranks = spawn_ranks([str(tmp_path)], ROOT, 2, script=ROOT / "tests/scripts/partner_swap.py", nodes=["n1", "n2"])
    proc = ok(wait_ranks(ranks, [], 120))
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("swapped", "failed"))]
    if missing is None:
        assert lines == ["swapped ['__0_0.distcp', '__1_0.distcp']"] * 2, proc.stdout
        assert (tmp_path / "tmp-0" / "__1_0.distcp").read_bytes() == bytes([1]) * 1000
    else:
        assert lines == ["failed: another rank's part of the snapshot failed",
                         "failed: FileNotFoundError: [Errno 2] No such file or directory: "
                         f"'{tmp_path / 'tmp-1' / '__1_0.distcp'}'"], proc.stdout


@pytest.mark.parametrize(("memory", "environ", "strategy", "taken"), [
    ("auto", {}, "fsdp", False),                                          # a job that cannot restart in place
    ("auto", {"TRAINER_IN_PLACE": "1"}, "ddp", True),                     # spares or a node range
    ("auto", {"TRAINER_STORE": "n1:29400:29401"}, "ddp", False),          # DDP regroups from the survivors' memory
    ("auto", {"TRAINER_STORE": "n1:29400:29401"}, "fsdp", True),          # the lost shard exists nowhere else
    ("off", {"TRAINER_STORE": "n1:29400:29401"}, "fsdp", False),          # off is off: a regroup reads the checkpoint
    ("on", {}, "ddp", True),
])
def test_auto_snapshots_where_a_restart_or_a_sharded_regroup_reads_them(memory: str, environ: dict[str, str],
                                                                         strategy: str, taken: bool) -> None:
    from trainer.core.config import load
    from trainer.core.env import job_info
    from trainer.runtime.saving.snapshots import wanted

    cfg = load([f"checkpoint.memory={memory}", f"dist.strategy={strategy}"])
    assert wanted(cfg, job_info(environ)) is taken
