"""GPU-only paths (NCCL, AMP, DataParallel benchmarks): skipped cleanly where there is no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import ROOT, SMALL, faults, ok, result_of, run_trainer, spawn_ranks

CHAR_LM = ROOT / "examples" / "char_lm" / "train.py"
LM = ["--max-steps", "24", "--eval-every", "12", "--max-bytes", "60000", "--batch-size", "8", "--sample", "1",
      "tracking.mode=disabled"]

gpus = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(gpus == 0, reason="no CUDA GPU on this machine")
needs_1_gpu = pytest.mark.skipif(gpus != 1, reason=f"needs exactly 1 CUDA GPU ({gpus} here)")
needs_2_gpus = pytest.mark.skipif(gpus < 2, reason=f"needs 2 CUDA GPUs ({gpus} here)")


@needs_2_gpus
def test_nccl_two_processes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(run_trainer([*SMALL, f"run.dir={run}", "train.device=cuda"], tmp_path, nproc=2, torchrun=True))
    assert "via torchrun on cuda" in proc.stdout
    assert len(set(result_of(run)["param_checksums"])) == 1


@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp(tmp_path: Path, precision: str) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "train.device=cuda", f"train.precision={precision}",
                    "checkpoint.every_steps=10"], tmp_path))
    state = torch.load(result_of(run)["checkpoint"], weights_only=True)
    # A disabled GradScaler's state is empty; fp16's holds its loss scale.
    assert ("scale" in state["scaler"]) == (precision == "fp16")
    assert result_of(run)["test_accuracy"] > 0.2


@needs_gpu
def test_compile_and_resnet18(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "train.device=cuda", "model.name=resnet18", "train.compile=true"], tmp_path))


def test_cpu_bf16_autocast_runs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "train.precision=bf16"], tmp_path))
    assert result_of(run)["global_step"] == 32


@needs_gpu
def test_async_staging_of_gpu_state_is_pinned_host_memory() -> None:
    from trainer.checkpoint import file as ckpt

    staging = ckpt.Staging()
    w = torch.randn(256, 256, device="cuda")
    staged = staging.stage({"model": {"w": w}})["model"]["w"]
    assert staged.device.type == "cpu" and staged.is_pinned() and torch.equal(staged, w.cpu())
    w.mul_(2)
    again = staging.stage({"model": {"w": w}})["model"]["w"]
    assert again.data_ptr() == staged.data_ptr() and torch.equal(again, w.cpu())


@needs_gpu
def test_async_saves_on_gpu_match_sync_saves(tmp_path: Path) -> None:
    args = [*SMALL, "train.device=cuda", "train.deterministic=true", "checkpoint.every_steps=8", "checkpoint.keep=10"]
    ok(run_trainer([*args, f"run.dir={tmp_path / 'sync'}"], tmp_path))
    ok(run_trainer([*args, f"run.dir={tmp_path / 'async'}", "checkpoint.async_save=true"], tmp_path))
    for name in ("step_00000008.pt", "step_00000016.pt"):
        # As resuming loads them: a synchronous save keeps the tensors' CUDA device in the file, an asynchronous
        # one writes its pinned host copies; the values are what must match.
        s = torch.load(tmp_path / "sync" / "checkpoints" / name, map_location="cpu", weights_only=True)["model"]
        a = torch.load(tmp_path / "async" / "checkpoints" / name, map_location="cpu", weights_only=True)["model"]
        assert all(torch.equal(s[k], a[k]) for k in s)


@needs_gpu
def test_char_lm_on_a_gpu_resumes_bit_identically_after_a_preemption(tmp_path: Path) -> None:
    """The example's own loop on CUDA with bf16 autocast: preempted mid-run and started again, it ends with the
    uninterrupted run's weights, bit for bit."""
    lm = [*LM, "train.device=cuda", "train.deterministic=true", "checkpoint.poll_steps=1"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(run_trainer([*lm, f"run.dir={ref}"], tmp_path, script=CHAR_LM))
    assert result_of(ref)["test_loss"] < 3.4
    stopped = run_trainer([*lm, f"run.dir={run}"], tmp_path, script=CHAR_LM, env=faults(preempt_at_step=9))
    assert stopped.returncode == 75, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    ok(run_trainer([*lm, f"run.dir={run}"], tmp_path, script=CHAR_LM))
    a, b = (torch.load(result_of(r)["checkpoint"], map_location="cpu", weights_only=True)["model"] for r in (run, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@needs_1_gpu
def test_two_processes_on_one_gpu_stop_at_once_with_the_cause(tmp_path: Path) -> None:
    """torchrun's two processes on a one-GPU machine (make train NPROC=2), and two srun tasks that both see the one
    GPU: NCCL refuses two ranks on one GPU; the error says so instead of blaming the rendezvous port."""
    proc = run_trainer([*SMALL, f"run.dir={tmp_path / 'a'}", "train.device=cuda"], tmp_path, nproc=2, torchrun=True)
    assert proc.returncode != 0
    assert "error: LOCAL_RANK: local rank 1 has no GPU of its own: 2 processes on this node, 1 GPU(s)" in proc.stderr
    assert "HINT: start one process per GPU (make train NPROC=1" in proc.stderr
    ranks = spawn_ranks([*SMALL, f"run.dir={tmp_path / 'b'}", "train.device=cuda"], tmp_path, split=True)
    outs = [p.communicate(timeout=120) for p in ranks]
    errors = "".join(err for _, err in outs)
    assert 2 in [p.returncode for p in ranks], outs
    assert "error: dist.backend:" in errors and "NCCL could not start on cuda:0" in errors, errors[-3000:]
    assert "MASTER_PORT" not in errors
