"""The examples run as documented: a non-image task by config alone, the tutorials' VGG16 preset, torchvision by name."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.builtin.build import build_parts
from trainer.core.config import load
from trainer.core.errors import UserError

from .conftest import ROOT, ok, result_of, run_trainer


def test_next_token_example_trains_on_two_processes_and_its_loss_falls(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(run_trainer(["config=examples/own_code/next_token.yaml", "tracking.mode=disabled", "run.report=false",
                           "train.max_steps=40", "train.eval_every=0", "data.kwargs.max_bytes=120000",
                           f"run.dir={run}"], ROOT, nproc=2))
    result = result_of(run)
    assert len(set(result["param_checksums"])) == 1
    # Uniform guessing over 256 bytes costs ln 256 ≈ 5.55 nats; 40 steps of a tiny transformer get well below 3.5.
    assert result["test_loss"] < 3.5 < math.log(256), proc.stdout
    assert result["test_accuracy"] > 0.15 and result["test_bits_per_byte"] == pytest.approx(result["test_loss"] / math.log(2))
    assert result["plugins"]["model"]["target"] == "seqtask.nets:TinyTransformer"


def test_next_token_example_trains_on_byte_shards_through_the_built_in_trainer(tmp_path: Path) -> None:
    """The same config on token files (make_shards.py, read by Shards + Tokens) on two processes: the loss falls
    and the run records the shards it read."""
    shards, run = tmp_path / "bytes", tmp_path / "run"
    ok(subprocess.run([sys.executable, str(ROOT / "examples" / "char_lm" / "make_shards.py"), str(shards), "--shards",
                       "2", "--shard-bytes", "60000"], capture_output=True, text=True, timeout=60))
    proc = ok(run_trainer(["config=examples/own_code/next_token.yaml", "tracking.mode=disabled", "run.report=false",
                           "train.max_steps=40", "train.eval_every=0", f"data.kwargs.shards={shards}",
                           f"run.dir={run}"], ROOT, nproc=2))
    result = result_of(run)
    assert len(set(result["param_checksums"])) == 1
    assert result["test_loss"] < 3.5 < math.log(256), proc.stdout
    assert result["plugins"]["data"]["kwargs"]["shards"] == str(shards)


def _one_step(args: list[str]) -> float:
    cfg = load(["data.name=synthetic", "data.synthetic_train_size=8", "data.synthetic_test_size=8", *args])
    parts = build_parts(cfg)
    x, y = parts.data.train[list(range(4))]  # type: ignore[index]
    assert x.shape == (4, 1, 28, 28)  # MNIST-sized: one channel, 28 px
    loss = parts.task.training_step(parts.model, (x, y))
    loss.backward()  # type: ignore[union-attr]
    assert all(p.grad is not None for p in parts.model.parameters() if p.requires_grad)
    return float(loss.detach())  # type: ignore[union-attr]


def test_the_tutorials_vgg16_on_mnist_preset_runs_a_step_on_28px_single_channel_images() -> None:
    cfg = load(["config=vgg16_mnist", "data.root=/nowhere"])
    assert (cfg.model.name, cfg.data.name) == ("vgg16", "mnist")
    assert math.isfinite(_one_step(["config=vgg16_mnist", "data.name=synthetic"]))


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v3_small", "efficientnet_b0", "googlenet", "regnet_x_400mf"])
def test_torchvision_models_by_name_run_a_step_on_28px_single_channel_images(name: str) -> None:
    torch.manual_seed(0)
    assert math.isfinite(_one_step([f"model.name={name}"]))


@pytest.mark.parametrize(("name", "words"), [
    ("densenet121", "densenet121 cannot take (1, 28, 28) inputs"),
    ("vit_b_16", "Expected 224 but got 28"),
    ("resnet1", "unknown model 'resnet1'"),
])
def test_models_that_cannot_take_the_input_say_so_before_training(name: str, words: str) -> None:
    with pytest.raises(UserError) as err:
        build_parts(load(["data.name=synthetic", "data.synthetic_train_size=8", f"model.name={name}"]))
    assert err.value.field == "model.name" and words in err.value.message
    assert "resnet18" in err.value.hint
