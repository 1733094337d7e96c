"""dist.strategy=fsdp (FSDP2) and sharded checkpoints, with real gloo processes on a CPU device mesh."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.builtin.models import SmallCNN
from trainer.builtin.train import param_checksum
from trainer.checkpoint import layout
from trainer.export import consolidated

from . import warm
from .conftest import ROOT, SMALL, clean_env, faults, ok, outputs, result_of, run_trainer, spawn_ranks

CHAR_LM = ROOT / "examples" / "char_lm" / "train.py"
LM = ["--max-steps", "24", "--eval-every", "12", "--max-bytes", "40000", "--batch-size", "8", "--sample", "0",
      "tracking.mode=disabled", "run.report=false", "checkpoint.poll_steps=1"]
FSDP = ["dist.strategy=fsdp"]
BUILTIN = [*SMALL, "train.epochs=2", "data.synthetic_train_size=512", *FSDP]  # 2 ranks × 32: 8 steps per epoch


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The run's final model as whole tensors, whatever the checkpoint format."""
    return consolidated(run)[1]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The char LM, 2 processes, uninterrupted: with ddp and with fsdp."""
    base = tmp_path_factory.mktemp("lm")
    for name, extra in {"ddp": [], "fsdp": FSDP}.items():
        ok(run_trainer([*LM, *extra, f"run.dir={base / name}"], base, nproc=2, script=CHAR_LM))
    return {"ddp": base / "ddp", "fsdp": base / "fsdp"}


def test_fsdp_reaches_the_loss_of_ddp(lm_runs: dict[str, Path]) -> None:
    ddp, fsdp = result_of(lm_runs["ddp"]), result_of(lm_runs["fsdp"])
    assert fsdp["strategy"] == "fsdp" and ddp["strategy"] == "ddp"
    # Same data, same initial weights: only the order of floating-point sums differs (reduce-scatter vs all-reduce).
    assert abs(fsdp["test_loss"] - ddp["test_loss"]) < 1e-3 * ddp["test_loss"], (fsdp["test_loss"], ddp["test_loss"])
    a, b = weights(lm_runs["ddp"]), weights(lm_runs["fsdp"])
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-3
    step = Path(result_of(lm_runs["fsdp"])["checkpoint"])
    assert step.is_dir() and {f.name for f in step.iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"}


def test_fsdp_preempted_at_a_random_step_resumes_bit_identically(tmp_path: Path, lm_runs: dict[str, Path]) -> None:
    run = tmp_path / "run"
    at = random.randrange(1, 22)
    ranks = spawn_ranks([*LM, *FSDP, f"run.dir={run}"], tmp_path, env=faults(preempt_at_step=at), script=CHAR_LM)
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75, 75], (at, outs)
    second = ok(run_trainer([*LM, *FSDP, f"run.dir={run}"], tmp_path, nproc=2, script=CHAR_LM))
    assert f"resumed from {run / 'checkpoints' / f'step_{at + 1:08d}'} at step {at + 1}" in second.stdout
    assert same(weights(run), weights(lm_runs["fsdp"])), f"preempted after step {at + 1}: weights differ"


@pytest.fixture(scope="module")
def every4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in trainer with fsdp, 2 processes, a synchronous sharded save every 4 steps, uninterrupted."""
    base = tmp_path_factory.mktemp("every4")
    ok(run_trainer([*BUILTIN, "checkpoint.every_steps=4", "checkpoint.keep=20", f"run.dir={base / 'run'}"], base,
                   nproc=2))
    return base / "run"


def test_sigkill_in_the_middle_of_a_sharded_save_resumes_from_the_previous_step(tmp_path: Path, every4: Path) -> None:
    run = tmp_path / "run"
    args = [*BUILTIN, f"run.dir={run}", "checkpoint.every_steps=4"]
    ranks = spawn_ranks(args, tmp_path, env=faults(save_delay_s=30, save_delay_from_step=8))
    folder = run / "checkpoints"
    deadline = time.monotonic() + 120
    # Rank 0 sleeps in the save of step 8 with its folder half made (step 4 commits at once): wait until it is there.
    while not ((folder / "step_00000004.json").exists() and (folder / ".step_00000008.tmp").is_dir()):
        assert all(p.poll() is None for p in ranks) and time.monotonic() < deadline, ranks[0].communicate()[0]
        time.sleep(0.1)
    for p in ranks:
        p.kill()
        p.wait()
    assert [m.name for m in layout.committed(folder)] == ["step_00000004.json"]
    resumed = ok(run_trainer(args, tmp_path, nproc=2))
    assert f"resumed from {folder / 'step_00000004'} at step 4" in resumed.stdout
    assert not list(folder.glob(".*.tmp")) and result_of(run)["global_step"] == 16
    assert same(weights(run), weights(every4))


RESHARD = ROOT / "tests" / "scripts" / "reshard_check.py"


def _loaded(run: Path, tmp: Path, nproc: int) -> dict[str, object]:
    """What a fresh fsdp job of ``nproc`` processes loads from ``run``'s checkpoint (step and whole-state hashes)."""
    proc = ok(run_trainer([f"checkpoint.resume={run}", f"run.dir={tmp / f'load{nproc}'}", "tracking.mode=disabled",
                           *FSDP], tmp, nproc=nproc, script=RESHARD))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("{"))
    return json.loads(line)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_sharded_checkpoint_resumes_onto_another_number_of_processes(tmp_path: Path, before: int, after: int) -> None:
    run = tmp_path / "run"
    args = [*BUILTIN, f"run.dir={run}", "checkpoint.poll_steps=1"]
    if before == 2:
        ranks = spawn_ranks(args, tmp_path, env=faults(preempt_at_step=5))
        outs = outputs(ranks, timeout=180)
        assert [p.returncode for p in ranks] == [75, 75], outs
    else:
        proc = run_trainer(args, tmp_path, env=faults(preempt_at_step=5))
        assert proc.returncode == 75, proc.stdout + proc.stderr
    # Exactly the saved state, whole, whatever the number of processes that load it.
    saved = consolidated(run)[1]
    fresh = SmallCNN(1, 10, 28)
    fresh.load_state_dict(saved)
    one, two = _loaded(run, tmp_path, 1), _loaded(run, tmp_path, 2)
    assert one == two and one["step"] == 6 and one["params"] == param_checksum(fresh), (one, two)
    # Training goes on from that step; the global batch changes with the process count, so it ends near (not at)
    # an uninterrupted run with the new count: within 0.3 nats of test loss (chance is ln 10 = 2.30).
    second = ok(run_trainer(args, tmp_path, nproc=after))
    assert f"resumed from {run / 'checkpoints' / 'step_00000006'} at step 6" in second.stdout
    assert f"written by {before} process{'es' if before > 1 else ''}, now {after}" in second.stdout
    ref = tmp_path / "ref"
    ok(run_trainer([*BUILTIN, f"run.dir={ref}"], tmp_path, nproc=after))
    assert abs(result_of(run)["test_loss"] - result_of(ref)["test_loss"]) < 0.3, (result_of(run), result_of(ref))


def test_export_gives_a_plain_state_dict_for_a_fresh_unwrapped_model(tmp_path: Path) -> None:
    """In bf16: the final evaluation leaves the root's bf16 parameters gathered, and the hash still reads the fp32
    weights the checkpoint holds."""
    run, out = tmp_path / "run", tmp_path / "model.pt"
    ok(run_trainer([*BUILTIN, f"run.dir={run}", "train.precision=bf16"], tmp_path, nproc=2))
    proc = warm.run([sys.executable, "-m", "trainer.export", str(run), str(out)], capture_output=True, text=True,
                          env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    fresh = SmallCNN(1, 10, 28)
    fresh.load_state_dict(torch.load(out, weights_only=True))  # strict: every name and shape fits
    # The trained, sharded model's parameters were gathered and hashed on every rank at the end of training.
    assert param_checksum(fresh) == result_of(run)["param_checksums"][0] == result_of(run)["param_checksums"][1]
    x = torch.randn(4, 1, 28, 28)
    assert fresh(x).shape == (4, 10)
    bad = warm.run([sys.executable, "-m", "trainer.export", str(tmp_path / "nothing"), str(out)],
                         capture_output=True, text=True, env=clean_env(), cwd=tmp_path)
    assert bad.returncode == 2 and "error: RUN_DIR" in bad.stderr and "HINT:" in bad.stderr
    for key in ("step", "nothing"):  # not an object's state (a traceback before), or not there
        bad = warm.run([sys.executable, "-m", "trainer.export", str(run), str(out), "--key", key], capture_output=True,
                       text=True, env=clean_env(), cwd=tmp_path)
        assert bad.returncode == 2 and "error: --key:" in bad.stderr, bad.stderr
        assert "HINT: choose one of the objects it holds: model, optimizer" in bad.stderr, bad.stderr


def test_async_sharded_saves_commit_the_same_state_as_sync_ones(tmp_path: Path, every4: Path) -> None:
    args = [*BUILTIN, "checkpoint.every_steps=4", "checkpoint.keep=20"]
    ok(run_trainer([*args, f"run.dir={tmp_path / 'async'}", "checkpoint.async_save=true"], tmp_path, nproc=2))
    s, a = layout.committed(every4 / "checkpoints"), layout.committed(tmp_path / "async" / "checkpoints")
    assert [m.name for m in s] == [m.name for m in a] and len(a) == 4  # 16 steps, every 4
    for ms, ma in zip(s, a, strict=True):
        assert same(consolidated(ms.with_suffix(""))[1], consolidated(ma.with_suffix(""))[1]), ma
    assert result_of(tmp_path / "async")["checkpoint_stall_s"] > 0


def test_ddp_with_sharded_checkpoints_spreads_the_writes_and_resumes_exactly(tmp_path: Path) -> None:
    args = [*SMALL, "train.epochs=2", "data.synthetic_train_size=512", "checkpoint.format=dcp",
            "checkpoint.poll_steps=1"]
    run = tmp_path / "run"
    ranks = spawn_ranks([*args, f"run.dir={run}"], tmp_path, env=faults(preempt_at_step=6))
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75, 75], outs
    step = run / "checkpoints" / "step_00000007"
    sizes = {f.name: f.stat().st_size for f in step.iterdir()}
    assert sizes["__0_0.distcp"] > 1000 and sizes["__1_0.distcp"] > 1000, sizes  # each rank wrote a share
    ok(run_trainer([*args, f"run.dir={run}"], tmp_path, nproc=2))
    ok(run_trainer([*args, f"run.dir={tmp_path / 'ref'}", "checkpoint.format=file"], tmp_path, nproc=2))
    assert same(weights(run), weights(tmp_path / "ref"))
    assert len(set(result_of(run)["param_checksums"])) == 1


@pytest.mark.parametrize(("args", "field"), [
    (["dist.strategy=fsdp", "checkpoint.format=file"], "checkpoint.format"),
    (["dist.strategy=fsdp", "train.precision=fp16", "train.device=cuda"], "train.precision"),
    (["dist.activation_checkpointing=true"], "dist.activation_checkpointing"),
    (["dist.strategy=zero3"], "dist.strategy"),
])
def test_bad_fsdp_settings_are_refused(tmp_path: Path, args: list[str], field: str) -> None:
    proc = run_trainer([*SMALL, *args], tmp_path)
    assert proc.returncode == 2 and f"error: {field}" in proc.stderr and "HINT:" in proc.stderr, proc.stderr


def test_activation_checkpointing_trains_the_same_model(tmp_path: Path, lm_runs: dict[str, Path]) -> None:
    run = tmp_path / "ac"
    ok(run_trainer([*LM, *FSDP, "dist.activation_checkpointing=true", f"run.dir={run}"], tmp_path, nproc=2,
                   script=CHAR_LM))
    a, b = weights(run), weights(lm_runs["fsdp"])
    assert a.keys() == b.keys()  # the wrappers leave the parameter names alone
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


def test_memory_advice_and_oom_hints_know_about_fsdp() -> None:
    from trainer.builtin.oom import out_of_memory
    from trainer.core.config import load
    from trainer.core.env import DistEnv
    from trainer.doctor.checks import memory_advice

    gib80 = 80 * 2**30
    what, hint = memory_advice(7_000_000_000, "adamw", gib80, False, 8) or ("", "")
    assert "104.3 GiB per GPU" in what and hint.startswith("dist.strategy=fsdp") and "13.0 GiB each on 8" in hint
    assert memory_advice(7_000_000_000, "adamw", gib80, True, 8) is None  # 1/8 each fits
    assert memory_advice(1_000_000, "sgd", gib80, False, 1) is None
    assert "more GPUs" in (memory_advice(70_000_000_000, "adamw", gib80, True, 8) or ("", ""))[1]
    env = DistEnv(0, 0, 4, 4, 0, 1, "127.0.0.1", 29500, None, "torchrun")
    err = out_of_memory(RuntimeError("CUDA out of memory"), load([]), env, torch.device("cpu"), 0, setup=True)
    assert "dist.strategy=fsdp" in err.hint and "1/4" in err.hint
    err = out_of_memory(RuntimeError("CUDA out of memory"), load(["dist.strategy=fsdp"]), env, torch.device("cpu"), 5)
    assert "dist.activation_checkpointing=true" in err.hint
