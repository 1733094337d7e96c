"""`make submit LAUNCHER=submitit WAIT=1` returns for a job that ended without results: Slurm's accounting keeps a job
cancelled while its requeue completed REQUEUED for good, and submitit's own wait reads accounting. Slurm's two
commands are stand-ins on PATH here (as sacct and squeue print for that job); the submitit job is submitit's own."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import submitit

from cluster.launch.launchers import ended

SQUEUE = """#!/bin/sh
# lists the job as RUNNING for the first LISTED calls, then no more (a file counts the calls)
n=$(cat "{calls}" 2>/dev/null || echo 0); echo $((n + 1)) > "{calls}"
[ "$n" -lt {listed} ] && echo RUNNING
exit 0
"""
SACCT = "#!/bin/sh\necho 'JobID|State|NodeList'\necho '990001|REQUEUED|n1'\n"  # as submitit asks it (--parsable2)


def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: int) -> Path:
    bin_dir, calls = tmp_path / "bin", tmp_path / "squeue-calls"
    bin_dir.mkdir()
    for name, text in (("squeue", SQUEUE.format(calls=calls, listed=listed)), ("sacct", SACCT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("listed", [0, 3])
def test_a_job_left_requeued_in_accounting_ends_the_wait_once_squeue_no_longer_lists_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: int) -> None:
    calls = slurm(tmp_path, monkeypatch, listed)
    job: submitit.SlurmJob[int] = submitit.SlurmJob(folder=tmp_path / "logs", job_id="990001", tasks=(0, 1))
    assert not job.done() and job.state == "REQUEUED"  # submitit's own wait would never end
    assert ended(job, poll_s=0.01, grace_s=0) is False
    assert int(calls.read_text()) == listed + 1  # it waited while squeue listed the job


def test_results_written_before_the_job_left_the_queue_are_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm(tmp_path, monkeypatch, listed=0)
    job: submitit.SlurmJob[int] = submitit.SlurmJob(folder=tmp_path / "logs", job_id="990001", tasks=(0,))
    job.paths.result_pickle.parent.mkdir(parents=True, exist_ok=True)
    job.paths.result_pickle.write_bytes(pickle.dumps(("success", 7)))
    assert ended(job, poll_s=0.01, grace_s=0) is True and job.results() == [7]


def test_an_attempts_error_is_no_end_while_slurm_still_lists_the_requeued_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank raised in attempt 0 and the verdict requeued the job: submitit's result file holds that error (it
    never removes one) and says done, while Slurm runs attempt 1. The wait goes on until squeue no longer lists the
    job; then attempt 1's result is the job's (the stand-in squeue writes it as the job leaves the queue)."""
    calls, later = tmp_path / "squeue-calls", tmp_path / "attempt-1.pkl"
    job: submitit.SlurmJob[int] = submitit.SlurmJob(folder=tmp_path / "logs", job_id="990001", tasks=(0,))
    job.paths.result_pickle.parent.mkdir(parents=True, exist_ok=True)
    job.paths.result_pickle.write_bytes(pickle.dumps(("error", "RuntimeError: attempt 0 failed")))
    later.write_bytes(pickle.dumps(("success", 7)))
    slurm(tmp_path, monkeypatch, listed=3)
    squeue = tmp_path / "bin" / "squeue"
    squeue.write_text(squeue.read_text().replace(
        "exit 0", f'[ "$n" -eq 2 ] && mv "{later}" "{job.paths.result_pickle}"\nexit 0'))
    assert ended(job, poll_s=0.01, grace_s=0) is True
    assert int(calls.read_text()) == 4 and job.results() == [7]
