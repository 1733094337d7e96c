"""The public session API for a user's own loop: the char LM example and a minimal loop, with real gloo processes."""

from __future__ import annotations

import os
import random
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import file as ckpt
from trainer.checkpoint import layout

from .conftest import ROOT, SMALL, clean_env, faults, ok, outputs, result_of, run_trainer, spawn_ranks
from .test_tracking import run_files
from .wandb_records import summary

CHAR_LM = ROOT / "examples" / "char_lm" / "train.py"
LM = ["--max-steps", "24", "--eval-every", "12", "--max-bytes", "60000", "--batch-size", "8", "--sample", "1",
      "tracking.mode=disabled", "run.report=false"]


def last_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(result_of(run)["checkpoint"], weights_only=True)["model"]  # type: ignore[no-any-return]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_char_lm_learns_and_resumes_bit_identically_after_a_preemption_at_a_random_step(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    proc = ok(run_trainer([*LM, f"run.dir={ref}"], tmp_path, nproc=2, script=CHAR_LM))
    # ln 256 ≈ 5.55 nats for a uniform guess over bytes; 24 steps of the tiny GPT reach well below 3.4.
    assert result_of(ref)["test_loss"] < 3.4, proc.stdout
    assert "sample:" in proc.stdout
    at = random.randrange(1, 22)  # signalled during step at+1; agreed at its end (poll_steps=1)
    ranks = spawn_ranks([*LM, f"run.dir={run}", "checkpoint.poll_steps=1"], tmp_path, env=faults(preempt_at_step=at),
                        script=CHAR_LM)
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75, 75], (at, outs)
    assert (run / "requeue.json").exists() and "exiting with 75" in outs[0]
    second = ok(run_trainer([*LM, f"run.dir={run}", "checkpoint.poll_steps=1"], tmp_path, nproc=2, script=CHAR_LM))
    assert f"resumed from {run / 'checkpoints' / f'step_{at + 1:08d}.pt'} at step {at + 1}" in second.stdout
    assert same(last_weights(run), last_weights(ref)), f"preempted after step {at + 1}: weights differ"
    ok(run_trainer([*LM, f"run.dir={run}"], tmp_path, nproc=2, script=CHAR_LM))  # resumed at its end: no step
    assert result_of(run)["test_loss"] == result_of(ref)["test_loss"]  # measured, not NaN


def test_char_lm_on_four_processes_resumes_bit_identically(tmp_path: Path) -> None:
    """An own loop under DDP at 4 processes: the resumed first step sums in the uninterrupted run's buckets."""
    lm = ["--max-steps", "24", "--eval-every", "12", "--max-bytes", "60000", "--batch-size", "4",
          "tracking.mode=disabled", "run.report=false", "checkpoint.poll_steps=1"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(run_trainer([*lm, f"run.dir={ref}"], tmp_path, nproc=4, script=CHAR_LM))
    at = random.randrange(1, 22)
    ranks = spawn_ranks([*lm, f"run.dir={run}"], tmp_path, world=4, env=faults(preempt_at_step=at), script=CHAR_LM)
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75] * 4, (at, outs[0])
    ok(run_trainer([*lm, f"run.dir={run}"], tmp_path, nproc=4, script=CHAR_LM))
    assert same(last_weights(run), last_weights(ref)), f"preempted after step {at + 1}: weights differ"


def test_char_lm_with_a_global_batch_continues_on_one_process_as_on_two(tmp_path: Path) -> None:
    """The example's --global-batch: preempted on 2 processes, finished on 1, it ends where the uninterrupted
    2-process run does (float tolerance: one process sums the micro-batches' gradients in another order)."""
    lm = [*LM, "--global-batch", "16", "checkpoint.poll_steps=1"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(run_trainer([*lm, f"run.dir={ref}"], tmp_path, nproc=2, script=CHAR_LM))
    ranks = spawn_ranks([*lm, f"run.dir={run}"], tmp_path, env=faults(preempt_at_step=9), script=CHAR_LM)
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75, 75], outs
    assert "global batch 16 = 2 process(es) × 8 samples × 1 accumulation step(s)" in outs[0]
    one = ok(run_trainer([*lm, f"run.dir={run}"], tmp_path, nproc=1, script=CHAR_LM))
    assert "global batch 16 = 1 process(es) × 8 samples × 2 accumulation step(s)" in one.stdout
    assert "written by 2 processes, now 1: the same global batches continue" in one.stdout
    a, b = last_weights(ref), last_weights(run)
    assert result_of(run)["global_step"] == 24 and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)


def test_char_lm_killed_in_the_middle_of_a_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*LM, f"run.dir={run}", "checkpoint.every_steps=5"]
    ranks = spawn_ranks(args, tmp_path, env=faults(save_delay_s=30, save_delay_from_step=10),
                        script=CHAR_LM)
    folder, deadline = run / "checkpoints", time.monotonic() + 150
    # The second save sleeps half-written for 30 s (the first commits at once): wait until it is under way.
    while not ((folder / "step_00000005.json").exists() and (folder / ".step_00000010.pt.tmp").exists()):
        assert all(p.poll() is None for p in ranks) and time.monotonic() < deadline
        time.sleep(0.2)
    for p in ranks:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert [m.name for m in layout.committed(folder)] == ["step_00000005.json"]
    proc = ok(run_trainer(args, tmp_path, nproc=2, script=CHAR_LM))
    assert "at step 5" in proc.stdout and result_of(run)["global_step"] == 24


USER_LOOP = '''
import sys

import torch

import trainer


def main() -> int:
    with trainer.Session(sys.argv[1:]) as sess:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 4, generator=gen)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        model = sess.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = sess.loader(data, batch_size=16)
        notes = {"seen": 0}  # the user's own state rides along in the checkpoint
        start = sess.restore(model=model, optimizer=opt, loader=loader, notes=notes)
        batches = loader.forever()
        for step in sess.steps(start, 20):
            xb, yb = next(batches)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            notes["seen"] += len(xb)
            sess.log({"loss": loss}, step)
            if sess.should_save(step):
                sess.save(step)
                if sess.preempted:
                    break
        return sess.finish({"test_loss": float(loss), "seen": notes["seen"]})


trainer.main(main)
'''


def test_a_minimal_user_loop_trains_saves_resumes_exactly_and_logs_one_wandb_run(tmp_path: Path) -> None:
    script = tmp_path / "user_loop.py"
    script.write_text(textwrap.dedent(USER_LOOP))
    assert "from trainer." not in USER_LOOP and "_" not in "".join(w for w in USER_LOOP.split() if "trainer." in w)
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(run_trainer([f"run.dir={ref}", "tracking.mode=disabled", "run.report=false"], tmp_path, nproc=2, script=script))
    args = [f"run.dir={run}", "tracking.mode=offline"]
    ranks = spawn_ranks(args, tmp_path, env=faults(preempt_at_step=8), script=script)
    outs = outputs(ranks, timeout=120)
    assert [p.returncode for p in ranks] == [75, 75], outs
    ok(run_trainer(args, tmp_path, nproc=2, script=script))
    assert same(last_weights(run), last_weights(ref))
    result = result_of(run)
    assert result["seen"] == result_of(ref)["seen"] == 20 * 16 * 1  # rank 0's count, carried across the restart
    files = run_files(run)
    assert len(files) == 2 and len({summary(f)["run_id"] for f in files}) == 1  # one W&B run across the restart
    steps = [s for f in files for s in sorted(summary(f)["history"])]
    assert steps == list(range(1, 21)), steps  # every step logged once


def test_session_errors_are_clear(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import trainer\n\ndef main():\n    with trainer.Session(['optim.lrr=1']) as s:\n        return 0\n\n"
                      "trainer.main(main)\n")
    proc = ok(run_trainer([], tmp_path, script=script), code=2)
    assert proc.stderr.startswith("error: optim.lrr: unknown key") and "HINT:" in proc.stderr
    assert "Traceback" not in proc.stderr


COMPILE_CACHE = """import os, sys, trainer

def main():
    with trainer.Session(sys.argv[1:]) as sess:
        sess.restore()
        print("cache:", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        return sess.finish()

trainer.main(main)
"""


@pytest.mark.parametrize("own", ["", "/scratch/my cache"])
def test_compile_cache_lives_in_the_run_folder_unless_the_user_chose_one(tmp_path: Path, own: str) -> None:
    """A requeued or recovered attempt on another node finds what the last one compiled (inductor's default is the
    node's /tmp); a folder the user set is theirs."""
    script = tmp_path / "loop.py"
    script.write_text(COMPILE_CACHE)
    env = clean_env({"TORCHINDUCTOR_CACHE_DIR": own})
    if not own:
        del env["TORCHINDUCTOR_CACHE_DIR"]
    proc = ok(run_trainer([f"run.dir={tmp_path / 'run'}", "tracking.mode=disabled"], tmp_path, env=env, script=script))
    assert f"cache: {own or tmp_path / 'run' / 'compile-cache'}" in proc.stdout, proc.stdout


def test_the_compile_caches_default_is_inductors_own() -> None:
    """trainer/runtime/compile_cache.py tells inductor's default from a user's choice by its value, written again there
    (torch's function for it is private): this pins the two together."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from trainer.runtime import compile_cache

    assert compile_cache.default() == default_cache_dir()


@pytest.mark.parametrize(("args", "said"), [
    (["audit.replay_every_steps=10"], "error: audit.replay_every_steps: needs DDP replicas"),
    (["run.dir=runs/x", "optim.lrr=1"], "error: optim.lrr: unknown key"),
])
def test_bad_input_writes_nothing(tmp_path: Path, args: list[str], said: str) -> None:
    """Refused before the run starts (exit 2 and a HINT): no run folder, no config.yaml, no events.jsonl."""
    proc = ok(run_trainer([*SMALL, *args], tmp_path), code=2)
    assert said in proc.stderr and "HINT:" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists(), sorted(p.name for p in (tmp_path / "runs").rglob("*"))


def test_a_checkpoint_of_another_layout_is_refused_with_a_hint(tmp_path: Path) -> None:
    import json

    script = tmp_path / "user_loop.py"
    script.write_text(textwrap.dedent(USER_LOOP))
    run = tmp_path / "run"
    ok(run_trainer([f"run.dir={run}", "tracking.mode=disabled"], tmp_path, script=script))
    manifest = layout.committed(run / "checkpoints")[0]
    path = manifest.with_suffix(".pt")
    state = torch.load(path, weights_only=True)
    state["version"] = 1  # as written before the session API
    size, digest = ckpt.save_atomic(path, state)
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "size": size, "xxh3_64": digest}))
    proc = ok(run_trainer([f"run.dir={run}", "tracking.mode=disabled"], tmp_path, script=script), code=2)
    assert "error: checkpoint.resume:" in proc.stderr and "has layout 1, this version reads layout 2" in proc.stderr
    assert "HINT: finish that run with the version that wrote it" in proc.stderr


def test_what_a_checkpoint_could_not_load_back_is_refused_when_saving() -> None:
    import numpy as np
    import pytest

    from trainer.core.errors import UserError
    from trainer.runtime.session import check_plain

    check_plain({"seen": 3, "best": 0.5, "tags": ["a"], "w": torch.ones(2), "none": None}, "notes")
    with pytest.raises(UserError, match=r"notes\['best'\]: a numpy.float64: checkpoints hold tensors"):
        check_plain({"best": np.float64(0.5)}, "notes")
    with pytest.raises(UserError, match=r"notes\['dir'\]: a pathlib.PosixPath"):
        check_plain({"dir": Path("/x")}, "notes")


LIFECYCLE = '''
import sys
import threading

import torch
import torch.distributed as dist

import trainer

# A session made where it cannot finish setting up (signal handlers need the main thread) leaves no process group.
failed = []
thread = threading.Thread(target=lambda: failed.append(_make()))


def _make():
    try:
        trainer.Session(sys.argv[1:])
    except ValueError as exc:
        return str(exc)


thread.start()
thread.join()
print("failed:", failed, "group left:", dist.is_initialized())


def main() -> int:
    with trainer.Session(sys.argv[1:]) as sess:
        print("rank", sess.env.rank, "of", sess.env.world_size, "main", sess.is_main)
        sess.log({"before_restore": 1.0}, 0)  # no run folder yet: printed, nothing else
        try:
            sess.save(1)
        except trainer.UserError as exc:
            print("save before restore:", exc)
        model = sess.wrap(torch.nn.Linear(2, 1))
        gen = torch.Generator().manual_seed(1)  # the user's own generator, no wrapper of their own
        start = sess.restore(model=model, gen=trainer.PerRank(gen))
        draws = []
        for step in sess.steps(start, 6):
            draws.append(float(torch.rand(1, generator=gen)))
            if sess.should_save(step):
                sess.save(step)
                if sess.preempted:
                    break
        print("draws", draws)
        return sess.finish()


trainer.main(main)
'''


def test_session_lifecycle_leaves_nothing_behind_and_a_generator_resumes_under_per_rank(tmp_path: Path) -> None:
    script = tmp_path / "lifecycle.py"
    script.write_text(LIFECYCLE)
    ref = ok(run_trainer(["tracking.mode=disabled", "run.report=false", f"run.dir={tmp_path / 'ref'}"], tmp_path, script=script))
    assert "signal only works in main thread" in ref.stdout and "group left: False" in ref.stdout, ref.stdout
    assert "rank 0 of 1 main True" in ref.stdout and "step 0: before_restore 1" in ref.stdout
    assert "save before restore: Session.restore: not called yet" in ref.stdout
    whole = eval(ref.stdout.split("draws ")[1].splitlines()[0])  # six draws of the user's generator
    run = [f"run.dir={tmp_path / 'run'}", "tracking.mode=disabled", "run.report=false", "checkpoint.poll_steps=1"]
    first = ok(run_trainer(run, tmp_path, script=script, env=faults(preempt_at_step=2)), code=75)
    second = ok(run_trainer(run, tmp_path, script=script))
    before = eval(first.stdout.split("draws ")[1].splitlines()[0])
    after = eval(second.stdout.split("draws ")[1].splitlines()[0])
    assert before + after == whole, (before, after, whole)  # the generator went on where it was saved
