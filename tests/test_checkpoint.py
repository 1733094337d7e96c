"""Checkpoints: commit protocol, step-exact resume, preemption signals, dead ranks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import file as ckpt
from trainer.checkpoint import layout

from . import warm
from .conftest import SMALL, clean_env, faults, go, held, ok, outputs, result_of, run_trainer, spawn_ranks

RESUME = [*SMALL, "train.epochs=2", "data.synthetic_train_size=512"]  # 2 ranks × batch 32: 8 steps per epoch


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(result_of(run)["checkpoint"], weights_only=True)["model"]


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Uninterrupted 2-process runs, by extra arguments, to compare resumed runs with."""
    base = tmp_path_factory.mktemp("ref")
    out = {}
    for key, extra in {"plain": [], "accum": ["optim.grad_accum=3"], "workers": ["data.num_workers=1"]}.items():
        ok(run_trainer([*RESUME, *extra, f"run.dir={base / key}"], base, nproc=2))
        out[key] = final_weights(base / key)
    return out


@pytest.mark.parametrize(("key", "micro"), [
    ("plain", 2),      # mid-epoch
    ("plain", 7),      # last step of epoch 0: saved as the start of epoch 1
    ("plain", 12),     # mid-epoch 1
    ("accum", 1),      # mid-epoch, windows of 3 micro-batches
    ("accum", 2),      # after the short last window of the epoch (8 = 3 + 3 + 2): saved as the next epoch's start
    ("workers", 5),    # persistent DataLoader workers
])
def test_resume_is_bit_identical(tmp_path: Path, reference: dict[str, dict[str, torch.Tensor]],
                                 key: str, micro: int) -> None:
    extra = {"plain": [], "accum": ["optim.grad_accum=3"], "workers": ["data.num_workers=1"]}[key]
    run = tmp_path / "run"
    # Ranks started like srun starts them (torchrun's agent would turn exit code 75 into 1).
    ranks = spawn_ranks([*RESUME, *extra, f"run.dir={run}"], tmp_path, env=faults(preempt_at_step=micro))
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75, 75], outs
    assert outs[0].count("received: saved") == 1
    assert not (run / "result.json").exists()
    second = ok(run_trainer([*RESUME, *extra, f"run.dir={run}"], tmp_path, nproc=2))
    assert second.stdout.count("resumed from") == 1
    assert_bit_identical(final_weights(run), reference[key])


def test_four_processes_resume_bit_identically(tmp_path: Path) -> None:
    """4 gloo processes, preempted at a random step: DDP's first step after the resume sums its gradients in the
    buckets the uninterrupted run used then (trainer/runtime/buckets.py), so the weights agree bit for bit."""
    args = [*RESUME, "data.synthetic_train_size=1024"]  # 4 ranks × batch 32: 8 steps per epoch, 16 in all
    ok(run_trainer([*args, f"run.dir={tmp_path / 'ref'}"], tmp_path, nproc=4))
    at, run = random.randrange(1, 14), tmp_path / "run"
    ranks = spawn_ranks([*args, f"run.dir={run}", "checkpoint.poll_steps=1"], tmp_path, world=4,
                        env=faults(preempt_at_step=at))
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75] * 4, (at, outs[0])
    second = ok(run_trainer([*args, f"run.dir={run}"], tmp_path, nproc=4))
    assert f"at step {at + 1}" in second.stdout, second.stdout
    assert_bit_identical(final_weights(run), final_weights(tmp_path / "ref"))


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*SMALL, f"run.dir={run}", "checkpoint.every_steps=10"]
    proc = warm.Popen([sys.executable, "-m", "trainer", *args], cwd=tmp_path,
                            env=clean_env(faults(save_delay_s=30, save_delay_from_step=20)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    folder = run / "checkpoints"
    deadline = time.monotonic() + 120
    # The second save sleeps half-written for 30 s (the first commits at once): wait until it is under way.
    while not ((folder / "step_00000010.json").exists() and (folder / ".step_00000020.pt.tmp").exists()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert [m.name for m in layout.committed(folder)] == ["step_00000010.json"]
    layout.verify(folder / "step_00000010.json")
    assert (folder / "latest").read_text() == "step_00000010.pt"
    resumed = ok(run_trainer(args, tmp_path))
    assert "resumed from" in resumed.stdout and "step_00000010.pt" in resumed.stdout
    assert not list(folder.glob(".*.tmp"))  # the next save cleared the leftover
    ok(run_trainer([*args, f"run.dir={tmp_path / 'ref'}"], tmp_path))
    assert_bit_identical(final_weights(run), final_weights(tmp_path / "ref"))


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*SMALL, f"run.dir={run}", "checkpoint.every_steps=10", "checkpoint.keep=5"]
    ok(run_trainer(args, tmp_path))
    expected = final_weights(run)
    newest = run / "checkpoints" / "step_00000032.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    resumed = ok(run_trainer(args, tmp_path))
    assert "skipping checkpoint" in resumed.stderr and "checksum" in resumed.stderr
    assert "step_00000030.pt" in resumed.stdout
    assert_bit_identical(final_weights(run), expected)


def test_truncated_and_unmarked_checkpoints_never_count(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "checkpoint.every_steps=10", "checkpoint.keep=5"], tmp_path))
    folder = run / "checkpoints"
    (folder / "step_00000032.pt").write_bytes((folder / "step_00000032.pt").read_bytes()[:100])
    with pytest.warns(UserWarning, match="truncated"):
        path, state = layout.find_resumable(run)  # type: ignore[misc]
    assert path.name == "step_00000030.pt" and state["step"] == 30
    (folder / "step_00000030.json").unlink()  # no marker: an unfinished save
    with pytest.warns(UserWarning):
        path, _ = layout.find_resumable(run)  # type: ignore[misc]
    assert path.name == "step_00000020.pt"


def test_keep_last_k_and_periodic_by_time(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "checkpoint.every_minutes=0.0005", "checkpoint.keep=2"],
                   tmp_path, env=faults(step_delay_s=0.05)))
    manifests = layout.committed(run / "checkpoints")
    assert [m.name for m in manifests][0] == "step_00000032.json" and len(manifests) == 2
    assert len(list((run / "checkpoints").glob("step_*.pt"))) == 2
    meta = json.loads(manifests[1].read_text())
    assert meta["global_step"] < 32  # a timed save happened before the final one


def test_async_saves_commit_and_match_sync_saves(tmp_path: Path) -> None:
    args = [*SMALL, "checkpoint.every_steps=4", "checkpoint.keep=20"]
    ok(run_trainer([*args, f"run.dir={tmp_path / 'sync'}"], tmp_path, nproc=2))
    ok(run_trainer([*args, f"run.dir={tmp_path / 'async'}", "checkpoint.async_save=true"], tmp_path, nproc=2))
    s, a = layout.committed(tmp_path / "sync" / "checkpoints"), layout.committed(tmp_path / "async" / "checkpoints")
    assert [m.name for m in s] == [m.name for m in a] and len(a) == 4  # 16 steps, every 4
    for ms, ma in zip(s, a, strict=True):
        layout.verify(ma)
        st = torch.load(ms.with_suffix(".pt"), weights_only=True)
        at = torch.load(ma.with_suffix(".pt"), weights_only=True)
        assert_bit_identical(st["model"], at["model"])
        assert len(at["rng"]) == 2  # every rank's generators


def _wait_for(proc: subprocess.Popen[str], text: str, timeout: float = 120) -> str:
    """Read proc's output until a line contains text."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{text!r} not seen:\n{''.join(seen)}")


def test_signal_saves_once_exits_75_and_rerun_resumes(tmp_path: Path) -> None:
    """Both ranks held after step 8 (a test fault), signalled as Slurm signals a step; the save comes at the next
    poll (step 10), once."""
    run = tmp_path / "run"
    args = [*SMALL, f"run.dir={run}", "data.num_workers=1"]
    ranks = spawn_ranks(args, tmp_path, env=faults(wait_at_step=7))
    held(run, ranks)
    for p in ranks:  # as Slurm does: every process of the step, DataLoader workers included
        os.killpg(p.pid, signal.SIGUSR2)
    outs = outputs(ranks, timeout=120)
    assert [p.returncode for p in ranks] == [75, 75], outs
    assert outs[0].count("SIGUSR2 received: saved") == 1 and "received" not in outs[1]
    assert [p.stem for p in layout.committed(run / "checkpoints")] == ["step_00000010"]
    marker = json.loads((run / "requeue.json").read_text())  # for launchers that lose the exit code
    assert marker["signal"] == "SIGUSR2" and Path(marker["checkpoint"]).is_file()
    ranks = spawn_ranks([*SMALL, f"run.dir={run}", "data.num_workers=1"], tmp_path)
    outs = outputs(ranks, timeout=120)
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert outs[0].count("resumed from") == 1
    assert not (run / "requeue.json").exists()
    assert result_of(run)["global_step"] == 16


def test_sigterm_also_saves(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ranks = spawn_ranks([*SMALL, f"run.dir={run}"], tmp_path, env=faults(wait_at_step=7))
    held(run, ranks)
    ranks[1].send_signal(signal.SIGTERM)  # one rank alone is enough: the flag is all-reduced
    go(run)
    outs = outputs(ranks, timeout=120)
    assert [p.returncode for p in ranks] == [75, 75], outs
    assert "SIGTERM received: saved" in outs[0]


def test_ctrl_c_ends_in_one_line_with_exit_130_and_an_echo_record(tmp_path: Path) -> None:
    """SIGINT (a terminal's Ctrl-C, or srun passing one on) while training: exit 130, one line and no traceback, and
    a record that says so: an echo of a stop from outside, not the user's error "sys.exit(1)"."""
    from trainer.core.records import exit_records
    run = tmp_path / "run"
    (rank,) = spawn_ranks([*SMALL, f"run.dir={run}"], tmp_path, world=1, env={**faults(wait_at_step=3),
                                                                               "RUN_DIR": str(run)})
    held(run, [rank])
    os.killpg(rank.pid, signal.SIGINT)
    (out,) = outputs([rank], timeout=120)
    assert rank.returncode == 130, out
    assert "interrupted (SIGINT)" in out and "Traceback" not in out, out
    (record,) = exit_records(next((run / "exits").iterdir()))
    assert (record.code, record.kind, record.echo, record.cause) == (130, "infrastructure", True,
                                                                     "interrupted by SIGINT"), record


def test_a_dead_rank_makes_the_other_exit_nonzero_instead_of_waiting(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ranks = spawn_ranks([*SMALL, f"run.dir={run}", "dist.timeout_s=600"], tmp_path, env=faults(wait_at_step=7))
    held(run, ranks)
    os.killpg(ranks[1].pid, signal.SIGKILL)
    go(run)
    out = ranks[0].communicate(timeout=240)[0]  # long before the 600 s collective timeout
    assert ranks[0].returncode not in (0, None), out
    assert "lost a peer" in out, out


def test_unresolvable_master_addr_fails_fast_and_clearly(tmp_path: Path) -> None:
    """Fast: at once, not after the rendezvous's 600 s timeout (the bound leaves a slow machine 4 × today's time)."""
    ranks = spawn_ranks([*SMALL, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=600"], tmp_path,
                        env={"MASTER_ADDR": "no-such-host.invalid"})
    outs = outputs(ranks, timeout=240)
    assert [p.returncode for p in ranks] == [2, 2], outs
    assert "error: MASTER_ADDR: host 'no-such-host.invalid' does not resolve" in outs[0] and "HINT:" in outs[0]


def test_out_of_memory_reports_hints_exits_2_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(run_trainer([*SMALL, f"run.dir={run}", "checkpoint.every_steps=10"], tmp_path,
                          env=faults(oom_at_step=14)), code=2)
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith("error: data.batch_size: out of memory (rank 0, step 15")
    assert lines[-1].startswith("HINT: halve the batch") and "optim.grad_accum=2" in lines[-1]
    assert "Traceback" not in proc.stderr
    assert [m.name for m in layout.committed(run / "checkpoints")] == ["step_00000010.json"]
    layout.verify(run / "checkpoints" / "step_00000010.json")


OOM_IN_SETUP = """
import sys

import torch

from trainer.runtime import ddp_group
from trainer.__main__ import main


def ddp(*args, **kwargs):  # DDP's parameter broadcast running out of GPU memory, on every rank
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")


ddp_group.DDP = ddp  # where the session makes its DDP
sys.exit(main())
"""


def test_out_of_memory_while_setting_up_goes_through_the_same_handler(tmp_path: Path) -> None:
    """Construction (model to device, resume, DDP wrapper) is outside the loop's handler but gets the same report."""
    (tmp_path / "oom_in_setup.py").write_text(OOM_IN_SETUP)  # the real entrypoint, with only DDP replaced
    ranks = spawn_ranks([*SMALL, f"run.dir={tmp_path / 'run'}"], tmp_path, module="oom_in_setup")
    outs = outputs(ranks, timeout=120)
    assert [p.returncode for p in ranks] == [2, 2], outs
    for rank, out in enumerate(outs):
        lines = out.strip().splitlines()
        assert lines[-2].startswith(f"error: model.name: out of memory (rank {rank}, setting up before step 0; "
                                    "batch 32 per process, fp32): CUDA out of memory. Tried to allocate"), out
        assert lines[-1].startswith("HINT: check that nothing else holds this GPU's memory"), out
        assert "Traceback" not in out


def test_out_of_memory_message_survives_an_empty_exception_text() -> None:
    from trainer.builtin.train import out_of_memory
    from trainer.core.env import DistEnv
    from trainer.core.schema import Config

    env = DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, None, "single")
    for setup in (False, True):
        err = out_of_memory(torch.OutOfMemoryError(), Config(), env, torch.device("cpu"), 5, setup=setup)
        assert err.message.endswith("fp32): OutOfMemoryError") and "step 5" in err.message, err.message


def test_async_staging_reuses_its_host_buffers() -> None:
    """The stall of an async save is one copy into buffers kept from the last save, not a fresh allocation."""
    staging = ckpt.Staging()
    weight = torch.randn(64, 32)
    state = {"model": {"w": weight}, "optimizer": {"state": {0: {"momentum": torch.ones(64, 32)}}}, "step": 1}
    first = staging.stage(state)
    assert torch.equal(first["model"]["w"], weight) and first["model"]["w"] is not weight
    ptr = first["model"]["w"].data_ptr()
    weight.add_(1.0)  # training goes on: the staged copy must not follow
    assert not torch.equal(first["model"]["w"], weight)
    second = staging.stage(state)
    assert second["model"]["w"].data_ptr() == ptr and torch.equal(second["model"]["w"], weight)
    assert second["step"] == 1 and torch.equal(second["optimizer"]["state"][0]["momentum"], torch.ones(64, 32))
    state["model"]["w"] = torch.zeros(8)  # a changed shape gets a buffer of its own
    third = staging.stage(state)
    assert third["model"]["w"].shape == (8,) and third["model"]["w"].data_ptr() != ptr


_OPENS: dict[str, list[str]] = {}  # while "on" is in it, the audit hook records every file opened


def _count_opens(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and "on" in _OPENS and isinstance(args[0], (str, os.PathLike)):
        _OPENS["on"].append(os.fspath(args[0]))  # type: ignore[arg-type]


def test_a_resume_reads_the_checkpoint_once_and_verifies_what_it_read(tmp_path: Path) -> None:
    """The hash is checked on the bytes that are then loaded: one read of the file, whatever its size."""
    state = {"w": torch.randn(256, 256), "step": 7}
    path = tmp_path / "step_00000007.pt"
    ckpt.FileCheckpointer(tmp_path, True, keep=2)._commit(state, path, 7)  # the commit itself, no process group needed
    sys.addaudithook(_count_opens)  # hooks last as long as the process: this one records only while switched on
    _OPENS["on"] = []
    try:
        found = layout.find_resumable(tmp_path)
    finally:
        opened = _OPENS.pop("on")
    assert found is not None and found[0] == path and torch.equal(found[1]["w"], state["w"])
    assert [p for p in opened if Path(p).name == path.name] == [str(path)]
