"""GPU-only paths (NCCL, AMP, DataParallel benchmarks): skipped cleanly where there is no GPU."""

from __future__ import annotations

import subprocess
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
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])  # reduce-overhead: CUDA graphs
def test_compile_and_resnet18(tmp_path: Path, mode: str) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "train.device=cuda", "model.name=resnet18", "train.compile=true",
                    f"train.compile_mode={mode}"], tmp_path))


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
    GPU: NCCL refuses two ranks on one GPU; the error says so instead of blaming the rendezvous port. Where Slurm says
    it gave the node one GPU (SLURM_GPUS_ON_NODE), the layout is refused before NCCL starts."""
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
    # Slurm says how many GPUs it gave the node: two tasks that each see its one GPU are refused before NCCL starts
    ranks = spawn_ranks([*SMALL, f"run.dir={tmp_path / 'c'}", "train.device=cuda"], tmp_path, split=True,
                        env={"SLURM_GPUS_ON_NODE": "1"})
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], outs
    errors = "".join(err for _, err in outs)
    assert "2 tasks on this node each see 1 of the 1 GPU(s) Slurm allocated here: tasks would share a GPU" in errors
    assert "HINT: one task per GPU: --gpus-per-node=2" in errors and "NCCL" not in errors, errors[-3000:]


@needs_gpu
def test_own_time_on_a_gpu_comes_from_cuda_events() -> None:
    """The straggler meter on a GPU: from leaving one step's synchronisation (its optimizer step) to the next step's
    last gradient, read from CUDA events once done. A host clock would see only the kernel launches; on one process
    nothing waits, so its own time is nearly the whole step. Beside another process that keeps the GPU busy, the events
    count its time slices too (H200, 2026-11-27: own 31.1 ms, wall 31.1 ms; alone 13.9 and 13.9)."""
    import time

    from trainer.runtime.health.straggler import Meter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    meter = Meter(model, [opt], own=True, device=torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")

    def steps(n: int) -> None:
        for _ in range(n):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps(2)  # cuBLAS's set-up and the allocator's first blocks: 0.1-0.3 s of host time in the first step (H200)
    assert meter.take(0) == 0.0  # the first call opens the window
    torch.cuda.synchronize()
    began = time.perf_counter()
    steps(10)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - began) / 10
    per_step = meter.take(10)
    assert 0.6 * wall < per_step < 1.1 * wall, (per_step, wall)  # each step nearly whole
    meter.close()


REPLAY_ON_GPU = """
import sys, torch, torchvision
from trainer.runtime.health.replay import digest, recompute
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
device = torch.device("cuda")
torch.manual_seed(0)
name = sys.argv[1]
if name == "resnet18":
    model = torchvision.models.resnet18(num_classes=10).to(device)
    x = torch.randn(16, 3, 64, 64, device=device)
else:  # dropout: the replay must restore the CUDA generator's state
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Dropout(0.5), torch.nn.Linear(512, 10)).to(device)
    x = torch.randn(64, 256, device=device)
model.train()
rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device)}
out = model(x)
grad_out = torch.randn_like(out)
out.backward(grad_out)
params = [p for p in model.parameters() if p.requires_grad]
source = [digest([p.grad]) for p in params]
capture = {"args": (x.cpu(),), "kwargs": {}, "grad_out": grad_out.cpu(), "rng": rng}
again = recompute(model, capture, device)
assert again == source, [i for i, (a, b) in enumerate(zip(again, source)) if a != b]
assert [digest([p.grad]) for p in params] == source  # this rank's own gradients put back
print("replayed", len(params), "gradients bit for bit")
"""


@needs_gpu
@pytest.mark.parametrize("model", ["resnet18", "dropout"])
def test_a_replayed_step_on_a_gpu_gives_its_gradients_bit_for_bit(tmp_path: Path, model: str) -> None:
    """The replay audit's premise on a GPU: with deterministic algorithms (train.deterministic, which the audit
    requires there) a step recomputed from its captured inputs, output gradient and random state has the same
    gradients, bit for bit: no false alarm from cuDNN's or cuBLAS's choice of kernels."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", REPLAY_ON_GPU, model], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0 and "bit for bit" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@needs_gpu
def test_a_killed_gpu_run_resumes_from_node_memory_bit_identically(tmp_path: Path) -> None:
    """Memory snapshots of a state on the GPU (pinned host staging into /dev/shm-like memory): a run killed between
    durable saves restarts from the snapshot and ends with the uninterrupted run's weights."""
    from trainer.export import consolidated

    from .conftest import spawn_ranks, wait_ranks

    args = [*SMALL, "train.device=cuda", "train.deterministic=true", "checkpoint.every_steps=10",
            "checkpoint.memory=on", "checkpoint.memory_every_steps=3", "checkpoint.poll_steps=1"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    env = {"TRAINER_MEMORY_DIR": str(tmp_path / "shm")}

    def launch(a: list[str], extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return wait_ranks(spawn_ranks(a, tmp_path, 1, {**env, **extra}, split=True, nodes=["n1"]), a, 240)

    ok(launch([*args, f"run.dir={ref}"], {"TRAINER_MEMORY_DIR": str(tmp_path / "shm-ref")}))
    assert launch([*args, f"run.dir={run}"], faults(kill_at_step=15, kill_rank=0)).returncode != 0
    second = ok(launch([*args, f"run.dir={run}"], {}))
    assert "(a snapshot in node memory) at step 15" in second.stdout, second.stdout[-3000:]
    a, b = consolidated(ref)[1], consolidated(run)[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
