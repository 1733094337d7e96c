"""GPU-only paths (NCCL, AMP, DataParallel benchmarks): skipped cleanly where there is no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import SMALL, ok, result_of, run_trainer

gpus = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(gpus == 0, reason="no CUDA GPU on this machine")
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
    assert ("_scale" in str(state["scaler"])) == (precision == "fp16")
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

    staging = ckpt._Staging()
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
        s = torch.load(tmp_path / "sync" / "checkpoints" / name, weights_only=True)["model"]
        a = torch.load(tmp_path / "async" / "checkpoints" / name, weights_only=True)["model"]
        assert all(torch.equal(s[k], a[k]) for k in s)
