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
    proc = ok(run_trainer([*SMALL, f"run.dir={run}", "train.device=cuda"], tmp_path, nproc=2))
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
