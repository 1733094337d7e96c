"""Real DDP: two gloo processes (the first test under torchrun, the others as srun starts them), checked through what
the trainer writes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .conftest import AUDIT, SMALL, clean_env, faults, go, held, ok, outputs, result_of, run_trainer


def test_two_processes_train_identical_weights_and_learn(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(run_trainer([*SMALL, "train.epochs=2", f"run.dir={run}"], tmp_path, nproc=2))
    result = result_of(run)
    assert result["world_size"] == 2
    c0, c1 = result["param_checksums"]
    assert c0 == c1  # gathered from each rank's own parameters
    assert result["test_accuracy"] > 3 * result["chance_accuracy"]
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in proc.stdout.splitlines() if ": loss " in line]
    assert len(losses) >= 4 and losses[-1] < losses[0]
    assert (run / "config.yaml").is_file() and Path(result["checkpoint"]).is_file()
    assert "done: test accuracy" in proc.stdout and str(run) in proc.stdout
    # Rank 0 alone prints: each report appears once.
    assert proc.stdout.count("done: test accuracy") == 1


def test_only_rank_0_writes_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    log = tmp_path / "audit"
    ok(run_trainer([*SMALL, f"run.dir={run}", "checkpoint.every_steps=5"], tmp_path, nproc=2,
                   env={"PYTHONPATH": str(AUDIT), "AUDIT_LOG": str(log)}))

    def writes(rank: int) -> list[str]:
        lines = Path(f"{log}.{rank}").read_text().splitlines()
        return [line for line in lines if str(tmp_path) in line.split("\t")[1] and not line.split("\t")[1].startswith(str(log))]

    assert any("checkpoints/step_" in w for w in writes(0))  # the audit sees rank 0's saves...
    assert writes(1) == []  # ...and no write at all from rank 1


def test_ddp_two_processes_equal_one_process_with_double_batch(tmp_path: Path) -> None:
    common = [*SMALL, "optim.name=sgd", "optim.momentum=0.9"]
    ok(run_trainer([*common, "data.batch_size=16", f"run.dir={tmp_path / 'two'}"], tmp_path, nproc=2))
    ok(run_trainer([*common, "data.batch_size=32", f"run.dir={tmp_path / 'one'}"], tmp_path, nproc=1))
    two = torch.load(result_of(tmp_path / "two")["checkpoint"], weights_only=True)["model"]
    one = torch.load(result_of(tmp_path / "one")["checkpoint"], weights_only=True)["model"]
    assert result_of(tmp_path / "two")["global_step"] == result_of(tmp_path / "one")["global_step"] == 32
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)


def test_gradient_accumulation_matches_a_bigger_batch(tmp_path: Path) -> None:
    common = [*SMALL, "optim.momentum=0.9"]
    ok(run_trainer([*common, "data.batch_size=8", "optim.grad_accum=2", f"run.dir={tmp_path / 'acc'}"], tmp_path, nproc=2))
    ok(run_trainer([*common, "data.batch_size=16", f"run.dir={tmp_path / 'big'}"], tmp_path, nproc=2))
    acc = torch.load(result_of(tmp_path / "acc")["checkpoint"], weights_only=True)["model"]
    big = torch.load(result_of(tmp_path / "big")["checkpoint"], weights_only=True)["model"]
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-4, atol=1e-5, msg=name)


def test_uneven_test_shards_with_buffers_do_not_hang(tmp_path: Path) -> None:
    # 65 test samples in batches of 32: rank 0 gets one batch more than rank 1. A DDP forward in evaluation would
    # broadcast resnet18's BatchNorm buffers on that extra batch and wait forever for rank 1.
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, "model.name=resnet18", "data.synthetic_train_size=128", "data.synthetic_test_size=65",
                    "dist.timeout_s=60", f"run.dir={run}"], tmp_path, nproc=2, timeout=300))
    assert result_of(run)["world_size"] == 2


def test_a_master_port_in_use_is_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    """Another process listens on MASTER_PORT (a second job on the node): rank 0 cannot serve the rendezvous and
    says MASTER_PORT with a HINT (exit 2: the first cause); the others reach a stranger, and once their wait is over
    end as an echo (exit 1) of rank 0's failure. None ends in a traceback."""
    import socket

    from .conftest import free_port, spawn_ranks

    port = free_port()
    stranger = socket.socket()
    stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stranger.bind(("", port))
    stranger.listen(8)  # accepts connections into its backlog, never answers
    try:
        ranks = spawn_ranks([*SMALL, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=6"], tmp_path,
                            env={"MASTER_PORT": str(port)})
        out0 = ranks[0].communicate(timeout=120)[0]
        assert ranks[0].returncode == 2, out0
        assert f"error: MASTER_PORT: rank 0: the rendezvous at 127.0.0.1:{port} failed" in out0 and "HINT:" in out0
        time.sleep(1)
    finally:
        stranger.close()  # as when the other job ends (or srun kills this one's tasks after rank 0's exit)
    out1 = ranks[1].communicate(timeout=120)[0]
    assert ranks[1].returncode == 1, out1
    assert f"rank 1: the rendezvous at 127.0.0.1:{port} did not answer in 6 s" in out1 and "Traceback" not in out0 + out1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("alone", [0, 1])
def test_a_rank_that_never_reaches_the_rendezvous_is_no_bad_input(tmp_path: Path, alone: int) -> None:
    """One rank of two starts (the other's node hangs before it): the one that came waits dist.timeout_s and ends
    as an echo of the missing rank (infrastructure: the job is retried), not "MASTER_PORT" bad input (exit 2, as if
    the port were taken, and the job failed for good)."""
    from trainer.core.records import exit_records

    from .conftest import free_port, warm

    run = tmp_path / "run"
    rank_env = {"RANK": str(alone), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RUN_DIR": str(run)}
    proc = warm.Popen([sys.executable, "-m", "trainer", *SMALL, f"run.dir={run}", "dist.timeout_s=5"], cwd=tmp_path,
                      env=clean_env(rank_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      start_new_session=True)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out
    said = "not every rank of 2 reached the rendezvous" if alone == 0 else "the rendezvous at 127.0.0.1:"
    assert f"rank {alone}: {said}" in out and "MASTER_PORT" not in out, out
    (record,) = exit_records(next((run / "exits").iterdir()))
    assert (record.kind, record.echo) == ("infrastructure", True), record


def test_a_job_store_that_is_not_there_is_named_with_a_hint(tmp_path: Path) -> None:
    """TRAINER_STORE names a port nothing listens on (the store never started): its own error and HINT, exit 2, not
    taken for a peer that never came (the client's connect attempts also end in a timeout)."""
    from .conftest import free_port, warm

    rank_env = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "TRAINER_STORE": f"127.0.0.1:{free_port()}:{free_port()}"}
    proc = warm.Popen([sys.executable, "-m", "trainer", *SMALL, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=3"],
                      cwd=tmp_path, env=clean_env(rank_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      start_new_session=True)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "error: TRAINER_STORE: rank 1: the job's store at 127.0.0.1:" in out, out
    assert "HINT: start python -m trainer.store first" in out and "Traceback" not in out, out


def test_the_same_master_port_right_after_another_run_is_no_error(tmp_path: Path) -> None:
    """The port a finished run used serves the next one (a requeued attempt, or training after the doctor)."""
    from .conftest import free_port, spawn_ranks

    port = str(free_port())
    for i in range(2):
        ranks = spawn_ranks([*SMALL, f"run.dir={tmp_path / str(i)}", "train.epochs=1", "data.synthetic_train_size=256"],
                            tmp_path, env={"MASTER_PORT": port})
        outs = outputs(ranks, timeout=120)
        assert [p.returncode for p in ranks] == [0, 0], outs


def test_torchrun_restarting_its_workers_continues_the_run(tmp_path: Path) -> None:
    """torchrun --max-restarts=1: a worker SIGKILLed, the agent starts both again in a new round of its rendezvous
    (its store still holds the first round's keys, which must not answer) and they continue from the checkpoint."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--max-restarts=1", "-m", "trainer", *SMALL, "train.epochs=2", "checkpoint.every_steps=4",
                             f"run.dir={run}"], cwd=tmp_path, env=clean_env(faults(wait_at_step=5)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        held(run, [proc], ranks=2)  # both workers after step 6, with step 4 saved
        worker = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _env_of(p).get("RANK") == "1"
                      and _env_of(p).get("TORCHELASTIC_RUN_ID") and str(run) in _cmdline(p))
        os.kill(worker, signal.SIGKILL)
        go(run)  # rank 0 goes on to find its peer gone; the workers of the next round do not stop there
        out, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and result_of(run)["outcome"] == "finished"
    assert Path(result_of(run)["resumed_from"]).name == "step_00000004.pt"
    assert out.count("done: test accuracy") == 1 and result_of(run)["world_size"] == 2  # torchrun's env: rank 0 prints


def _env_of(proc: Path) -> dict[str, str]:
    try:
        return dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
    except (OSError, ValueError):
        return {}


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_text()
    except OSError:
        return ""
