"""The ledger and the run tools without Slurm: records, states, the table (golden), filters, logs by attempt and
rank, finding a run, and their errors. ``squeue``/``sacct`` here are stand-ins on PATH printing fixed answers; the
dev cluster test (tests/test_runs_cluster.py) runs the same tools against real jobs."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import time
from pathlib import Path

import pytest

from cluster.__main__ import main as cluster_main
from cluster.job import ledger
from cluster.runs import logs as run_logs
from cluster.runs import table as runs
from cluster.runs.status import resolve
from trainer.core.errors import UserError

from .conftest import small_tmpfs

GOLDEN = Path(__file__).parent / "golden"
HOSTILE = "a'; echo x"


@pytest.fixture
def book(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ledger of this test's own, and Slurm stand-ins that answer what ``squeue.out``/``sacct.out`` hold."""
    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path / "ledger"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("squeue", "sacct"):
        out = tmp_path / f"{tool}.out"
        out.write_text("")
        (bin_dir / tool).write_text(f"#!/bin/sh\ncat {shlex.quote(str(out))}\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path


def put(fields: dict[str, object]) -> Path:
    """Write a record as any version may have: from its JSON form."""
    return ledger.write(ledger.Record.from_json(fields))


def job(book: Path, job_id: str, name: str, age_s: float, events: list[dict[str, object]] | None = None,
        result: dict[str, object] | None = None, **more: object) -> Path:
    run_dir = book / "runs" / job_id
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps({"t": 1.0, **e}) + "\n" for e in events or []))
    if result is not None:
        (run_dir / "result.json").write_text(json.dumps(result))
    put({"kind": "job", "name": name, "job_id": job_id, "launcher": "sbatch", "run_dir": str(run_dir),
                  "log": str(book / f"{name}-{job_id}.out"), "submitted_at": time.time() - age_s, **more})
    return run_dir


def start(job_id: str, restart: int) -> dict[str, object]:
    return {"event": "job_start", "job_id": job_id, "restart": restart, "nodes": 2}


def test_a_record_is_replaced_whole_and_a_batch_script_never_overwrites_the_submitters(
        book: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = put({"kind": "job", "name": "x", "job_id": "7", "run_dir": HOSTILE, "args": [HOSTILE]})
    assert json.loads(path.read_text())["run_dir"] == HOSTILE and path.name == "7.json"
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert ledger.register("/elsewhere", ["k=v"]) == 0
    assert json.loads(path.read_text())["run_dir"] == HOSTILE  # the submitting side's record stays
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    monkeypatch.setenv("SLURM_JOB_NAME", "by-hand")
    ledger.register("/runs/8", ["optim.lr=0.1"])
    (rec,) = [r for r in ledger.records() if r.job_id == "8"]
    assert (rec.name, rec.args, rec.by_hand, rec.run_dir) == ("by-hand", ("optim.lr=0.1",), True, "/runs/8")
    assert not list((book / "ledger").glob(".*tmp"))  # no temporary file left behind
    put({"kind": "job", "name": "x", "job_id": "../../9", "run_dir": "r"})
    assert (book / "ledger" / ".._.._9.json").exists()  # a job id never leaves the ledger folder


@pytest.mark.parametrize(("queue", "acct", "events", "result", "extra", "want"), [
    ("5|PENDING|(Priority)|me", "", [], None, {}, ("pending", 0)),
    ("5|PENDING|(Priority)|me", "5|PENDING|None assigned", [], None, {}, ("pending", 0)),  # sacct lists it too
    ("5|PENDING|(BeginTime)|me", "5|PREEMPTED|n1\n5|PENDING|None assigned", [start("5", 0)], None, {}, ("requeued", 1)),
    ("5|RUNNING|n[1-2]|me", "5|REQUEUED|n1\n5|RUNNING|n[1-2]", [start("5", 0), start("5", 1)], None, {},
     ("running", 2)),
    ("", "5|COMPLETED|n1", [start("5", 0)], {"outcome": "finished"}, {}, ("finished", 1)),
    ("", "5|FAILED|n2", [start("5", 0)], {"outcome": "failed", "class": "infrastructure"}, {},
     ("failed: infrastructure", 1)),
    ("", "5|CANCELLED|n1", [start("5", 0)], None, {}, ("cancelled", 1)),
    ("", "5|REQUEUED|n1", [start("5", 0)], None, {}, ("ended", 1)),  # cancelled during its requeue: sacct lags
    ("", "", [start("5", 0)], None, {"cancelled_at": 1.0}, ("cancelled", 1)),  # no accounting: the ledger knows
    ("", "", [start("5", 0), {"event": "attempt_end", "job_id": "5", "attempt": "0", "class": "user_error",
                              "decision": "fail"}], None, {}, ("failed: user_error", 1)),
    ("", "", [start("5", 0), {"event": "attempt_end", "job_id": "5", "attempt": "0", "class": "finished",
                              "decision": "done"}], None, {}, ("finished", 1)),
    ("", "", [start("5", 0), start("5", 1)], {"outcome": "finished"}, {}, ("finished", 2)),
    ("", "", [start("5", 0)], None, {}, ("ended", 1)),
    ("", "", [], None, {}, ("never started", 0)),
])
def test_a_jobs_state_and_attempts_come_from_slurm_while_it_lives_else_from_its_folder(
        book: Path, queue: str, acct: str, events: list[dict[str, object]], result: dict[str, object] | None,
        extra: dict[str, object], want: tuple[str, int]) -> None:
    (book / "squeue.out").write_text(queue + "\n")
    (book / "sacct.out").write_text(acct + "\n")
    job(book, "5", "t", 10, events, result, **extra)
    (row,) = runs.rows()
    assert (row.state, row.attempts) == want


def test_without_squeue_the_state_says_so(book: Path) -> None:
    (book / "bin" / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact' >&2; exit 1\n")
    (book / "bin" / "sacct").write_text("#!/bin/sh\nexit 1\n")
    job(book, "5", "t", 10, [start("5", 0)])
    assert runs.rows()[0].state == "unknown (no squeue)"


def fill(book: Path) -> None:
    (book / "squeue.out").write_text("41|RUNNING|n[1-2]|me\n42|PENDING|(BeginTime)|me\n")
    (book / "sacct.out").write_text("40|COMPLETED|n1\n41|RUNNING|n[1-2]\n42|PREEMPTED|n3\n42|PENDING|None assigned\n"
                                    "43|FAILED|n2\n")
    job(book, "40", "vgg16-mnist", 2 * 86400 + 60, [start("40", 0), {"event": "first_step", "step": 1, "stop": 400},
                                                    {"event": "metrics", "step": 400, "values": {"loss": 0.0312}}],
        {"outcome": "finished"})
    job(book, "41", "char-lm", 3700, [start("41", 0), {"event": "first_step", "step": 1, "stop": 500},
                                      {"event": "metrics", "step": 120, "values": {"loss": 2.41, "lr": 0.001}}])
    job(book, "42", "a-rather-long-experiment-name-that-goes-on", 600, [start("42", 0)])
    job(book, "43", "train", 90, [start("43", 0)], {"outcome": "failed", "class": "user_error"})


def test_the_table_at_a_fixed_width_is_golden(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(book)
    assert cluster_main(["runs", "--width", "90"]) == 0
    out = capsys.readouterr().out
    path = GOLDEN / "runs-table-90.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text(), f"the table changed; UPDATE_GOLDEN=1 pytest {__file__} to accept"
    assert max(len(line) for line in out.splitlines()) <= 90


@pytest.mark.parametrize(("args", "jobs"), [
    ([], ["43", "42", "41", "40"]),
    (["--state", "failed"], ["43"]),  # every failure, whatever its class
    (["--state", "requeued"], ["42"]),
    (["--since", "2h"], ["43", "42", "41"]),
    (["char-*"], ["41"]),
    (["4[01]"], ["41", "40"]),
])
def test_filters_and_json(book: Path, capsys: pytest.CaptureFixture[str], args: list[str], jobs: list[str]) -> None:
    fill(book)
    assert cluster_main(["runs", "--json", *args]) == 0
    assert [r["job"] for r in json.loads(capsys.readouterr().out)] == jobs


def test_a_long_ledger_shows_the_newest_screenful_and_says_how_many_more(
        book: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LINES", "24")  # a terminal of 24 lines, wherever the test runs
    for i in range(60):
        job(book, str(1000 + i), f"run-{i}", 60 * (60 - i))  # job 1059 is the newest
    assert cluster_main(["runs", "-n", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out[1:6]] == ["1059", "1058", "1057", "1056", "1055"]
    assert out[6] == "… and 55 older runs (--all shows every one, -n N the newest N)" and len(out) == 7
    assert cluster_main(["runs", "--all"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 61
    assert cluster_main(["runs"]) == 0  # a screenful
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 22 and out[-1].startswith("… and 40 older runs")
    assert cluster_main(["runs", "--json"]) == 0  # for scripts: every run
    assert len(json.loads(capsys.readouterr().out)) == 60


def test_an_empty_ledger_and_a_bad_since_say_so(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster_main(["runs"]) == 0
    assert "no runs recorded in" in capsys.readouterr().out
    assert cluster_main(["runs", "--since", "yesterday"]) == 2
    err = capsys.readouterr().err
    assert "--since" in err and "HINT:" in err and "Traceback" not in err


LOG = """\
attempt 0 of job 77 starts on n[1-2]
0: tracking: W&B offline run abc
1: rank 1 says hello
0: step 10 loss 2.3
1: rank 1 step 10
srun: error: n2: task 1: Killed
attempt 1 of job 77 starts on n[1-2]
0: resumed from step 10
1: rank 1 again
"""


@pytest.mark.parametrize(("rank", "attempt", "want"), [
    (1, "0", ["rank 1 says hello", "rank 1 step 10"]),
    (1, "1", ["rank 1 again"]),
    (0, None, ["tracking: W&B offline run abc", "step 10 loss 2.3", "resumed from step 10"]),
    (None, "1", ["attempt 1 of job 77 starts on n[1-2]", "0: resumed from step 10", "1: rank 1 again"]),
])
def test_logs_split_attempts_and_ranks(rank: int | None, attempt: str | None, want: list[str]) -> None:
    assert run_logs.select(LOG.splitlines(), "77", rank, attempt, labelled=True) == want


def test_a_repeated_mark_of_one_attempt_does_not_split_it_and_a_trials_lines_are_its_own() -> None:
    lines = ["attempt 0 of job 5 starts on n1", "attempt 0 of job 5 starts on n1", "a", "attempt 0.1 of job 5 starts",
             "b", "attempt 1 of job 5 starts", "c"]
    assert [(k, len(p)) for k, p in run_logs.attempts(lines, "5")] == [("0", 3), ("0.1", 2), ("1", 2)]
    worker = ["worker 0: trial 3 lr=0.1", "0: x", "worker 0: trial 5 lr=0.2", "0: y",
              "worker 0: re-attached to trial 3 lr=0.1 (it resumes)", "0: z"]
    assert run_logs.trial_lines(worker, 0, 3) == [worker[0], "0: x", worker[4], "0: z"]


def test_logs_through_the_command_line(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job(book, "77", "lm", 10)
    (book / "lm-77.out").write_text(LOG)
    assert cluster_main(["logs", "lm", "--rank", "1", "--attempt", "0"]) == 0
    assert capsys.readouterr().out.splitlines() == ["rank 1 says hello", "rank 1 step 10"]


def test_a_run_is_found_by_folder_job_id_or_name_and_the_newest_name_wins(book: Path) -> None:
    old = job(book, "50", "same", 100)
    job(book, "51", "same", 10)
    assert resolve("same").job_id == "51"
    assert resolve("50").job_id == "50" and resolve(str(old)).job_id == "50"


@pytest.mark.parametrize(("ref", "squeue", "words"), [
    ("no-such-run", "", "no run named 'no-such-run'"),
    ("999", "", "job 999 is not in the ledger"),
    ("998", "someone", "job 998 belongs to someone"),  # squeue -j 998 -o %u
    (".", "", "no recorded run lives there"),
])
@pytest.mark.parametrize("tool", ["status", "logs", "cancel", "resubmit"])
def test_bad_references_get_a_clear_message(book: Path, capsys: pytest.CaptureFixture[str], ref: str, squeue: str,
                                            words: str, tool: str) -> None:
    (book / "squeue.out").write_text(squeue + "\n")
    assert cluster_main([tool, ref]) == 2
    err = capsys.readouterr().err
    assert words in err and "HINT:" in err and "Traceback" not in err


def test_a_resubmitted_jobs_state_is_its_own_not_its_successors(book: Path) -> None:
    run_dir = job(book, "70", "lm", 100, [start("70", 0), {"event": "attempt_end", "job_id": "70", "attempt": "0",
                                                            "class": "infrastructure", "decision": "fail"}])
    put({"kind": "job", "name": "lm", "job_id": "71", "run_dir": str(run_dir), "resubmit_of": "70"})
    (run_dir / "result.json").write_text('{"outcome": "finished"}')  # the resubmitted job's
    (run_dir / "events.jsonl").write_text((run_dir / "events.jsonl").read_text() + json.dumps(
        {"t": 2.0, **start("71", 0)}) + "\n")
    assert {r.job: r.state for r in runs.rows()} == {"70": "failed: infrastructure", "71": "finished"}


def test_odd_records_and_files_do_not_break_the_table(book: Path) -> None:
    run_dir = job(book, "80", "odd", 10, result={"outcome": "finished"})
    (run_dir / "events.jsonl").write_text('[1]\n{"t": 1, "event": "metrics", "values": [3]}\n')
    put({"kind": "job", "name": "x", "job_id": "81", "run_dir": "/nowhere", "submitted_at": "yesterday"})
    (book / "ledger" / "junk.json").write_text("[1, 2]")
    assert sorted((r.job, r.state) for r in runs.rows()) == [("80", "finished"), ("81", "never started")]


def test_status_shows_attempts_progress_and_the_failed_ranks_last_lines(
        book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = job(book, "77", "lm", 10, [
        start("77", 0), {"event": "first_step", "step": 1, "stop": 100},
        {"event": "attempt_end", "job_id": "77", "attempt": "0", "class": "infrastructure",
         "cause": "rank 1 on n2 was killed (SIGKILL)", "decision": "requeue"},
        start("77", 1), {"event": "metrics", "step": 20, "values": {"loss": 1.5}},
        {"event": "checkpoint", "step": 20}, {"event": "attempt_end", "job_id": "77", "attempt": "1",
                                               "class": "user_error", "cause": "rank 1: ValueError: bad", "decision": "end"}],
        {"outcome": "failed", "class": "user_error", "cause": "rank 1: ValueError: bad", "where": "train.py:12"})
    (run_dir / "tracking.json").write_text('{"run_id": "abc123"}')
    (book / "lm-77.out").write_text(LOG)
    assert cluster_main(["status", "77"]) == 0
    out = capsys.readouterr().out
    assert "job lm  job 77  failed: user_error" in out and "progress: step 20/100, loss=1.5" in out
    assert "attempts (2):" in out and "infrastructure: rank 1 on n2 was killed (SIGKILL) → requeue" in out
    assert "W&B run: abc123" in out and "failed: rank 1: ValueError: bad (train.py:12)" in out
    assert out.rstrip().endswith("--- last lines of rank 1, attempt 1:\nrank 1 again")


def test_a_command_status_offers_to_paste_runs_as_given_whatever_the_name(
        book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run named ``a'; echo x``: the logs command status printed ran ``echo x`` when pasted."""
    import shlex

    name = "a'; echo x"
    job(book, "78", name, 10, [start("78", 0)], {"outcome": "finished"})
    assert cluster_main(["status", name]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "(python -m cluster logs" in x]
    assert shlex.split(line.split("(", 1)[1].split(" [--rank")[0]) == ["python", "-m", "cluster", "logs", name]


def test_cancel_and_resubmit_refuse_what_they_cannot_do(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job(book, "60", "done", 10, [start("60", 0)], {"outcome": "finished"})
    assert cluster_main(["cancel", "60"]) == 1
    assert "not pending or running: nothing to cancel" in capsys.readouterr().out
    (book / "squeue.out").write_text("60|RUNNING|n1|me\n")
    assert cluster_main(["resubmit", "60"]) == 2
    assert "still pending or running" in capsys.readouterr().err
    (book / "squeue.out").write_text("")
    assert cluster_main(["resubmit", "60", "model.name=resnet18"]) == 2
    assert "cannot change when a run resumes" in capsys.readouterr().err
    job(book, "61", "cmd", 10, command=["python", "t.py"], args=["python", "t.py"])
    assert cluster_main(["resubmit", "61", "optim.lr=0.1"]) == 2
    assert "this run is a command" in capsys.readouterr().err


def test_a_cancel_slurm_made_is_not_undone_by_a_ledger_it_cannot_write(
        book: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The ledger's disk is full: scancel has worked, so `cancel` says so and warns, instead of a traceback after it."""
    (book / "bin" / "scancel").write_text(f"#!/bin/sh\necho \"$@\" > {shlex.quote(str(book / 'cancelled'))}\n")
    (book / "bin" / "scancel").chmod(0o755)
    with small_tmpfs(book / "full", "64k") as full:
        monkeypatch.setenv(ledger.LEDGER_ENV, str(full))
        job(book, "62", "busy", 10, [start("62", 0)])
        (book / "squeue.out").write_text("62|RUNNING|n1|me\n")
        with contextlib.suppress(OSError), open(full / "filler", "wb") as f:
            f.write(b"x" * (1 << 20))
        assert cluster_main(["cancel", "62"]) == 0
    assert (book / "cancelled").read_text().split() == ["62"]
    out = capsys.readouterr().out
    assert "cancelled busy (job 62)" in out and "warning: the ledger could not record the cancel" in out, out


def test_submit_checks_that_a_module_can_be_imported(capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster_main(["submit", "--dry-run", "--module", "no_such_mod"]) == 2
    err = capsys.readouterr().err
    assert "'no_such_mod' cannot be imported here" in err and "HINT:" in err
    assert cluster_main(["submit", "--dry-run", "--module", "trainer.launch", "--", "--help"]) == 0


def test_a_ledger_error_is_a_message_not_a_traceback(book: Path) -> None:
    with pytest.raises(UserError, match="no run named"):
        resolve("nothing")


def test_follow_prints_new_lines_of_the_rank_until_the_job_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "x-9.out"
    log.write_text("attempt 0 of job 9 starts on n1\n1: old line\n1: half a li")  # a line being written
    record = ledger.Record(kind="job", job_id="9", launcher="sbatch", log=str(log), name="x")
    writes = iter(["ne\n0: rank 0 line\n1: new ", "line\nattempt 1 of job 9 starts on n2\n1: after requeue\n", ""])

    def alive() -> bool:  # the job writes a little more between polls, then ends
        more = next(writes)
        with open(log, "a") as f:
            f.write(more)
        return bool(more)

    assert run_logs.show(record, 1, None, True, alive, poll_s=0.01) == 0
    assert capsys.readouterr().out.splitlines() == ["old line", "half a line", "new line",  # whole, once
                                                    "attempt 1 of job 9 starts on n2", "after requeue"]


def test_status_of_a_run_that_is_not_running_shows_no_eta(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job(book, "90", "gone", 10, [start("90", 0), {"event": "first_step", "step": 1, "stop": 100, "t": 10.0},
                                 {"event": "progress", "step": 50, "t": 20.0}], cancelled_at=time.time())
    assert cluster_main(["status", "90"]) == 0
    out = capsys.readouterr().out
    assert "cancelled" in out and "progress: step 50/100" in out, out
    assert "ETA" not in out and "steps/s" not in out, out
