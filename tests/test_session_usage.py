"""A loop of its own that uses the session slightly differently from the example, as users of Fabric or Accelerate
would: each slip that used to train for nothing, resume wrong in silence or fail after the whole run is refused at
the call, with the call named (tests/scripts/session_usage.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import ROOT, ok, result_of, run_trainer

SCRIPT = ROOT / "tests" / "scripts" / "session_usage.py"
ARGS = ["tracking.mode=disabled", "run.report=false", "checkpoint.poll_steps=1"]


def refusals(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("refused ", "allowed"))]


@pytest.mark.parametrize("nproc", [1, 2])
def test_each_slip_is_refused_at_its_call(tmp_path: Path, nproc: int) -> None:
    proc = ok(run_trainer(["slips", *ARGS, f"run.dir={tmp_path / 'run'}"], tmp_path, nproc, script=SCRIPT))
    two = nproc > 1
    expected = [
        "refused Session(extra_config=…)['data']: a pathlib.PosixPath: checkpoints hold tensors, numbers, strings, "
        "None and lists/dicts of them",  # a checkpoint that could never be loaded back
        "refused Session.log('phase'): 'warm-up' is not a number",  # was a ValueError traceback
        "refused Session.loader(sampler=…): would replace the sampler an exact resume needs",
        *(["refused Session.restore(model=…): a model Session.wrap never saw, on 2 processes: nothing keeps its "
           "replicas equal"] if two else []),  # the replicas trained apart and rank 0's was saved
        *(["refused Session.wrap: the model is already wrapped (DistributedDataParallel)"] if two else []),
        "refused Session.restore: not called yet: it opens the run folder and loads the checkpoint",
        "refused Session.restore(counter=…): a 'int' object has no state to checkpoint",  # failed at finish, all work lost
        "refused Session.restore: a loader from Session.loader is not among the objects: a resume would read its "
        "first batches again",
        "refused Session.restore: called a second time",
        "refused Session.loader: called after restore: its position would start over at every resume",
    ]
    assert refusals(proc.stdout) == expected * nproc, proc.stdout + proc.stderr  # each rank's, in rank order
    assert result_of(tmp_path / "run")["outcome"] == "finished"


def test_a_loop_without_steps_resumes_at_its_own_step_and_one_without_finish_is_told(tmp_path: Path) -> None:
    """The session learns the step from should_save: finish saved the trained weights as step 0 and the next run
    trained every step again. A loop that trained and never called finish left no checkpoint and said nothing."""
    run = [*ARGS, f"run.dir={tmp_path / 'run'}"]
    unfinished = ok(run_trainer(["train", "4", "--no-finish", *run], tmp_path, script=SCRIPT))
    assert "warning: closed without finish(): no final checkpoint nor result.json (return sess.finish())" in \
        unfinished.stdout + unfinished.stderr
    assert not (tmp_path / "run" / "result.json").exists()
    first = ok(run_trainer(["train", "6", *run], tmp_path, script=SCRIPT))
    assert "trained 6 steps" in first.stdout and result_of(tmp_path / "run")["global_step"] == 6
    second = ok(run_trainer(["train", "9", *run], tmp_path, script=SCRIPT))
    assert "at step 6" in second.stdout + second.stderr and "trained 3 steps" in second.stdout, second.stdout
    assert json.loads((tmp_path / "run" / "result.json").read_text())["global_step"] == 9
