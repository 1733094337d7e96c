"""The verdict on an attempt (cluster/job/verdict.py), its inputs (trainer/core/exits.py) and the suspects list, as
tables. The same rules run for real on the dev cluster in test_healing.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.job import placement, suspects
from cluster.job.judge import Verdict, judge, srun_failures
from cluster.job.nodes import excluded, job_log, parse_fields
from cluster.job.placement import Next, Shape
from cluster.job.rules import Limits, decide, repeated, storm
from trainer.core import exits
from trainer.core.records import AttemptEnd, ExitRecord, RequeueMarker
from trainer.core.regroup import RegroupFailed

from .conftest import clean_env


def rec(rank: int, node: str, code: int | None, kind: str = "", t: float = 0.0, **more: Any) -> ExitRecord:
    return ExitRecord.from_json({"rank": rank, "node": node, "code": code, "class": kind, "cause": more.pop("cause", kind),
                                 "t": t, **more})


def ends(*events: dict[str, Any]) -> list[AttemptEnd]:
    return [AttemptEnd.from_json(e) for e in events]


ECHO = {"echo": True, "cause": "lost a peer mid-collective"}
JUDGED = [  # records, srun's lines, rc, marker -> class, blamed nodes, words of the cause
    ([rec(0, "n1", 0, "finished"), rec(1, "n2", 0, "finished")], [], 0, False, "finished", [], "every rank"),
    ([rec(0, "n1", 75, "preempted"), rec(1, "n2", 75, "preempted")], [], 75, False, "preempted", [], "saved"),
    ([rec(0, "n1", 0, "finished"), rec(1, "n2", None)], [], 0, False, "finished", [], "every rank"),  # srun: all 0
    ([rec(0, "n1", 1, "infrastructure", **ECHO), rec(1, "n2", None)], [("n2", "1", "Killed")], 137, False,
     "infrastructure", ["n2"], "rank 1 on n2 was killed"),
    ([rec(0, "n1", 1, "infrastructure", **ECHO), rec(1, "n2", None)], [], 137, False,
     "infrastructure", ["n2"], "ended without a record"),
    # a warm spare that joined and its node's rank, both killed: each named as such
    ([rec(0, "n1", None), rec(exits.SPARE_BASE + 1001, "n1", None), rec(1, "n2", 1, "infrastructure", **ECHO)],
     [("n1", "0", "Killed")], 137, False, "infrastructure", ["n1"], "rank 0 and spare 1001 on n1 were killed"),
    # the user's error recorded late (after the echo of its peer): still the first cause, never blamed on a node
    ([rec(0, "n1", 1, "infrastructure", t=1, **ECHO), rec(1, "n2", 1, "user_error", t=2, cause="ValueError: x",
                                                           where="m.py:3")],
     [("n1", "0", "Exited with exit code 1")], 137, False, "user_error", [], "ValueError: x"),
    ([rec(0, "n1", 3, "infrastructure", cause="hang: stuck rank(s) 1 on n2", blame=["n2"]), rec(1, "n2", None)],
     [], 137, False, "infrastructure", ["n2"], "hang"),
    ([rec(0, "n1", 1, "resource", cause="out of memory"), rec(1, "n2", 1, "infrastructure", **ECHO)], [], 1, False,
     "resource", [], "out of memory"),
    ([rec(0, "n1", 1, "infrastructure", cause="device or interconnect error: NCCL error")], [], 1, False,
     "infrastructure", ["n1"], "NCCL"),
    ([], [], 1, False, "user_error", [], "without a record"),  # e.g. the image lacks a module the tasks import
    ([], [("n3", "0", "Killed")], 137, False, "infrastructure", ["n3"], "killed"),
    # Slurm refused the step before any task started: the placement's failure, never the user's
    ([], [("", "step", "Unable to create step for job 7: Requested node configuration is not available")], 1, False,
     "infrastructure", [], "could not create the job step"),
    ([rec(0, "n1", 1, "infrastructure", **ECHO), rec(1, "n2", 75, "preempted")], [], 1, True, "preempted", [], "saved"),
    # a plain script that aborts in gloo's teardown after every other rank finished: the work is done
    ([rec(0, "n1", 134, "user_error", aborted=True), rec(1, "n2", 0, "finished")], [], 134, False, "finished", [],
     "aborted in teardown"),
    ([rec(0, "n1", 134, "user_error", aborted=True), rec(1, "n2", None)], [], 134, False, "user_error", [], ""),
    ([], [("n2", "launch", "srun could not start tasks there: Communication connection failure")], 1, False,
     "infrastructure", ["n2"], "could not start"),
    # an exit code without a record (a missing module in the image): the user's, no healthy node blamed
    ([], [("n1", "0", "Exited with exit code 1")], 1, False, "user_error", [], "without a record"),
    ([rec(0, "n1", 134, "user_error", aborted=True, cause="crashed (SIGABRT)")], [], 134, False, "user_error", [],
     "crash"),  # alone: not done
    ([rec(0, "n1", None)], [("n1", "0", "Out Of Memory")], 137, False, "resource", [], "memory limit"),
    ([rec(0, "n1", None), rec(1, "n2", 1, "infrastructure", **ECHO)], [("n1", "0", "Exited with exit code 137")],
     137, False, "infrastructure", ["n1"], "killed"),  # a container's SIGKILL
    ([rec(0, "n1", 3, "infrastructure", cause="hang: every rank waits in the same collective", blame=[])], [], 3, False,
     "infrastructure", [], "same collective"),  # nobody to blame
    # srun's TERM to a command still saving after rank 0 saved and left the marker: an echo, the run is saved
    ([rec(0, "n1", 75, "preempted"), rec(1, "n2", 143, "infrastructure", echo=True, cause="killed by SIGTERM")],
     [], 143, True, "preempted", [], "saved"),
    # the survivors of a killed rank went on in place (Session.regroup) and finished: the work is done
    ([rec(0, "n1", 0, "finished", went_on_without=[2]), rec(1, "n2", 0, "finished", went_on_without=[2]),
      rec(2, "n3", None)], [("n3", "2", "Killed")], 137, False, "finished", ["n3"],
     "rank 2 on n3 lost, and the others went on without a restart"),
    # … a rank whose own watchdog reported it stuck before the store killed it (a hang the others went on from)
    ([rec(0, "n1", 0, "finished", went_on_without=[2]), rec(1, "n2", 0, "finished", went_on_without=[2]),
      rec(2, "n3", 3, "infrastructure", cause="hang: no progress for 3 s; stuck rank(s) 2 on n3", blame=["n3"])],
     [("n3", "2", "Killed")], 137, False, "finished", ["n3"], "rank 2 on n3 (hang: no progress for 3 s"),
    # … every rank as started lost in turn, and spares (their records name the places they took) finished the run
    ([rec(0, "n1", None), rec(1, "n2", None), rec(1_000_000, "n3", 0, "finished", went_on_without=[0, 1]),
      rec(1_001_002, "n1", 0, "finished")], [("n2", "1", "Killed"), ("n1", "0", "Killed")], 137, False, "finished",
     ["n1", "n2"], "rank 0 on n1, rank 1 on n2 lost"),
    # … but not a rank they did not go on without, nor a survivor that failed afterwards
    ([rec(0, "n1", 0, "finished", went_on_without=[2]), rec(1, "n2", None), rec(2, "n3", None)],
     [("n2", "1", "Killed")], 137, False, "infrastructure", ["n2"], "rank 1 on n2 was killed"),
    ([rec(0, "n1", 1, "infrastructure", went_on_without=[2], **ECHO), rec(2, "n3", None)],
     [("n3", "2", "Killed")], 137, False, "infrastructure", ["n3"], "killed"),
]


@pytest.mark.parametrize(("records", "srun", "rc", "marker", "kind", "blame", "words"), JUDGED)
def test_judge_names_the_first_cause(records: list[ExitRecord], srun: list[tuple[str, str, str]], rc: int,
                                     marker: bool, kind: str, blame: list[str], words: str) -> None:
    v = judge(records, srun, rc, RequeueMarker("SIGUSR2") if marker else None)
    assert (v.kind, v.blame) == (kind, blame) and words in v.cause, v


def test_srun_lines_of_this_attempt_before_srun_ends_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.write_text("attempt 0 of job 9 starts on n[1-2]\nsrun: error: n1: task 0: Killed\n"
                   "attempt 1 of job 9 starts on n[1,3]\ntraining...\nsrun: error: n3: task 1: Exited with exit code 1\n"
                   "srun: launch/slurm: _step_signal: Terminating StepId=9.0\nsrun: error: n1: task 0: Killed\n")
    assert srun_failures(log, "1", "9") == [("n3", "1", "Exited with exit code 1")]
    assert srun_failures(log, "0", "9")[0] == ("n1", "0", "Killed")
    assert srun_failures(tmp_path / "missing", "0", "9") == []
    log.write_text("attempt 0.1 of job 9 starts on n1,n3\n"
                   "srun: error: Task launch for StepId=9.1 failed on node n3: Communication connection failure\n")
    assert srun_failures(log, "0.1", "9") == [("n3", "launch", "srun could not start tasks there: Communication "
                                                                "connection failure")]
    log.write_text("attempt 0.2 of job 9 starts on n1,n3\n"  # the line srun prints, as Slurm 22.05-26.05 word it
                   "srun: error: Unable to create step for job 9: Requested node configuration is not available\n")
    assert srun_failures(log, "0.2", "9") == [("", "step", "Unable to create step for job 9: Requested node "
                                                          "configuration is not available")]


LIMITS = Limits(max_requeues=2, max_failures=1, suspects=Path("/nonexistent"), suspect_hours=1)


@pytest.mark.parametrize(("kind", "before", "action", "words"), [
    ("finished", [], "done", "finished"),
    ("preempted", ["preempted"], "requeue", "requeue 2 of max_requeues=2"),
    ("preempted", ["preempted", "preempted"], "fail", "2 requeues done"),
    ("infrastructure", ["preempted", "preempted"], "requeue", "failure 1 of max_failures=1"),  # budgets are separate
    ("infrastructure", ["infrastructure"], "fail", "max_failures=1"),
    ("user_error", [], "fail", "not retried"),
    ("resource", [], "fail", "not retried"),
])
def test_decide_keeps_separate_budgets(kind: str, before: list[str], action: str, words: str) -> None:
    got, why = decide(Verdict(kind, "x"), ends(*({"class": c} for c in before)), LIMITS)
    assert got == action and words in why, why


def test_recoveries_in_place_count_against_max_failures() -> None:
    """A regroup is an infrastructure failure: max_failures=1 is spent by one, so the next failure ends the job."""
    got, why = decide(Verdict("infrastructure", "x"), [], LIMITS, regrouped=1)
    assert got == "fail" and "failure 2 (1 recovered in place), max_failures=1" in why, why
    assert decide(Verdict("finished", "x"), [], LIMITS, regrouped=3)[0] == "done"


REGROUPED = [{"event": "job_start", "job_id": "5", "attempt": "0"},
             {"event": "attempt", "job_id": "5", "attempt": "0"},
             {"event": "attempt", "job_id": "5", "attempt": "0.1", "regroup": True, "within": "0"},
             {"event": "attempt", "job_id": "6", "attempt": "0.1", "regroup": True, "within": "0"},  # another job's
             {"event": "attempt_end", "job_id": "5", "attempt": "0", "class": "infrastructure"},
             {"event": "attempt", "job_id": "5", "attempt": "0.2"},
             {"event": "attempt", "job_id": "5", "attempt": "0.3", "regroup": True, "within": "0.2"}]


@pytest.mark.parametrize(("attempt", "upto", "nxt", "besides", "failures"), [
    ("0", 2, "0.2", None, 3),  # recoveries in place and restarts in place share one count
    ("0.2", 6, "0.4", "0.2", 2),  # the session leaves its own attempt's out (it counts them itself)
    ("1", 6, "1.1", "0", 2),  # a requeued attempt (Slurm's restart count 1) starts its own count
])
def test_attempts_inside_an_allocation_are_numbered_once(attempt: str, upto: int, nxt: str, besides: str | None,
                                                         failures: int) -> None:
    events = REGROUPED[:upto + 1]
    assert exits.next_attempt(events, "5", attempt) == nxt
    assert exits.failures(REGROUPED, "5", besides) == failures
    assert exits.later_attempt("2.3", 2) == "2.5" and exits.later_attempt("4", 1) == "4.1"


def test_a_failure_at_the_same_step_on_other_nodes_is_the_codes() -> None:
    earlier = ends({"class": "infrastructure", "step": 40, "blamed": ["n2"]})
    assert repeated(Verdict("infrastructure", "x", blame=["n3"], step=40), earlier) == earlier[0]
    assert repeated(Verdict("infrastructure", "x", blame=["n3"], step=41), earlier) is None
    assert repeated(Verdict("infrastructure", "x", blame=["n2"], step=40), earlier) is None  # the same node again


@pytest.mark.parametrize("version", ["22.05", "24.11", "26.05"])
def test_the_job_log_is_found_in_what_each_slurm_version_prints(version: str) -> None:
    """`scontrol show job -o` of a batch job with one output file, as each version printed it (tests/golden)."""
    fields = parse_fields((Path(__file__).parent / "golden" / f"scontrol-job-{version}.txt").read_text().strip())
    log = job_log(fields)
    assert log is not None and log.name.startswith("golden-") and log.suffix == ".out", fields.get("StdErr")
    assert fields["Partition"] == "dev" and fields["NumNodes"] == "1" and excluded(fields) == []


def test_scontrol_fields_keep_paths_with_spaces() -> None:
    fields = parse_fields("JobId=5 JobName=train Partition=dev AllocNode:Sid=localhost:1 ExcNodeList=n2 NumNodes=2-2 "
                          "StdErr=/runs/my logs/train-5.out StdIn=/dev/null")
    assert fields["StdErr"] == "/runs/my logs/train-5.out" and fields["ExcNodeList"] == "n2"
    assert fields["Partition"] == "dev" and fields["NumNodes"] == "2-2"


def test_suspects_expire_and_clear(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    suspects.add(path, ["n2"], 1, "7", "device error", hard=True)
    suspects.add(path, ["n3"], -1, "8", "old", hard=True)
    assert suspects.active(path) == ["n2"]
    assert suspects.active(path, now=time.time() + 7200) == []
    assert suspects.clear(path, "n2") == ["n2"] and suspects.active(path) == []
    assert suspects.clear(path, "all") == ["n3"] and suspects.load(path) == {}
    path.write_text("not json")
    assert suspects.active(path) == []  # a broken list never stops a job


NOW = 1_000_000.0


def blame(job: str, t: float = NOW - 60, hard: bool = False, hours: float = 24) -> dict[str, Any]:
    return {"t": t, "until": t + hours * 3600, "job": job, "cause": "rank 1 was killed", "hard": hard}


@pytest.mark.parametrize(("evidence", "after", "avoided", "words"), [
    ([blame("7")], 2, False, "blamed by 1 job(s)"),  # one SIGKILL is no evidence against a node
    ([blame("7"), blame("7", NOW - 30)], 2, False, "blamed by 1 job(s)"),  # nor is the same job twice
    ([blame("7"), blame("8")], 2, True, "blamed by 2 jobs (7, 8)"),
    ([blame("7")], 1, True, "blamed by 1 jobs"),
    ([blame("7", hard=True)], 2, True, "hard evidence from job 7"),
    ([blame("7", NOW - 90000), blame("8")], 2, False, "blamed by 1 job(s) (8)"),  # the older one expired
])
def test_a_node_is_avoided_on_evidence_not_on_one_blame(tmp_path: Path, evidence: list[dict[str, Any]], after: int,
                                                        avoided: bool, words: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"n2": evidence}))
    (s,) = suspects.standing(path, after, now=NOW)
    assert (s.node, s.avoided) == ("n2", avoided) and words in s.why, s
    assert suspects.active(path, after, now=NOW) == (["n2"] if avoided else [])


def test_a_list_written_before_evidence_was_weighed_reads_as_one_blame(tmp_path: Path) -> None:
    path, now = tmp_path / "s.json", time.time()
    path.write_text(json.dumps({"n1": {"until": now + 3600, "job": "3", "cause": "killed", "since": now - 10}}))
    (s,) = suspects.standing(path, 2, now=now)
    assert not s.avoided and s.evidence[0]["job"] == "3" and s.evidence[0]["t"] == now - 10
    suspects.add(path, ["n1"], 1, "4", "killed again")
    assert suspects.active(path, 2) == ["n1"]


@pytest.mark.parametrize(("ordered", "usable", "need", "avoided", "again"), [
    (["n1"], {"n1", "n2", "n3"}, 2, ["n1"], []),
    (["n3", "n1"], {"n1", "n2", "n3"}, 2, ["n3"], ["n1"]),  # the older blame is forgotten first
    (["n1", "n2"], {"n1", "n2"}, 2, [], ["n1", "n2"]),  # nothing to spare: every node is used again
    (["n9", "n1"], {"n1", "n2", "n3"}, 2, ["n9", "n1"], []),  # a node outside the partition costs nothing
    (["n1", "n1"], {"n1", "n2", "n3"}, 1, ["n1"], []),
])
def test_avoiding_fails_open(ordered: list[str], usable: set[str], need: int, avoided: list[str],
                             again: list[str]) -> None:
    assert suspects.fail_open(ordered, usable, need) == (avoided, again)


ALLOC = ["n1", "n2", "n3"]


@pytest.mark.parametrize(("allocation", "ordered", "shape", "expected"), [
    # a spare node takes over: the same 2 nodes' worth, the blamed node kept as the new spare
    (ALLOC, ["n1"], Shape(2, 2, True), Next(True, ["n1"], [], [], 2, ["n2", "n3"])),
    # the next failure on n3: n1 (blamed earlier) is used again rather than leaving the job short
    (ALLOC, ["n3", "n1"], Shape(2, 2, True), Next(True, ["n3"], ["n1"], [], 2, ["n1", "n2"])),
    # a node range shrinks onto the nodes left and gives the lost one back
    (ALLOC, ["n2"], Shape(2, 3, True), Next(True, ["n2"], [], ["n2"], 2, ["n1", "n3"])),
    # a range with a spare: the spare takes over first, nothing given back
    (["n1", "n2", "n3", "n4"], ["n2"], Shape(2, 3, True), Next(True, ["n2"], [], [], 3, ["n1", "n3", "n4"])),
    (["n1", "n2"], ["n1"], Shape(2, 3, True), None),  # at the range's minimum: the queue, not here
    # the second loss of a range that gave n3 back: the allocation is n1, n2 now, so n3 (blamed earlier) is no
    # node to use again: the queue (where the range may grow back)
    (["n1", "n2"], ["n2", "n3"], Shape(2, 3, True), None),
    (ALLOC, ["n1"], Shape(2, 3, False), None),  # no loop in the batch script
    (ALLOC, [], Shape(3, 3, True), Next(True, [], [], [], 3, ALLOC)),  # nobody blamed: the same nodes again
])
def test_where_the_next_attempt_runs_inside_the_allocation(allocation: list[str], ordered: list[str], shape: Shape,
                                                           expected: Next | None) -> None:
    assert placement.here(allocation, ordered, shape) == expected


def test_an_attempt_that_blames_nobody_restarts_here_whatever_was_blamed_before() -> None:
    """A step Slurm refused (no node to blame) after an earlier loss: the same nodes again, not the queue."""
    nxt = placement.here(["n1", "n2"], ["n3"], Shape(2, 3, True), current=[])
    assert nxt is not None and nxt.step == ["n1", "n2"]


def test_a_job_of_two_on_three_nodes_meets_three_faults_and_keeps_running() -> None:
    """The issue's job: a rank killed on n1, a preemption, a rank killed on n3 (max_failures=10): each requeue
    avoids the newest blame and uses n1 again instead of failing with two of three nodes excluded."""
    order = placement.blame_order(["n3"], [["n1"], []], [], ["n1"])
    assert order == ["n3", "n1"]
    nxt = placement.queue(order, {"n1", "n2", "n3"}, 2)
    assert (nxt.avoid, nxt.again) == (["n3"], ["n1"])
    assert "n1 used again although blamed" in nxt.describe("partition dev")


@pytest.mark.parametrize(("progressed", "before", "after", "stops"), [
    (False, [False, False], 3, True),
    (False, [True, False], 3, False),  # progress two attempts ago: not a storm
    (False, [False], 3, False),
    (True, [False, False], 3, False),
    (None, [False, False], 3, False),  # unknown: never a reason to stop
    (False, [False, False], 0, False),  # storm_after 0: off
    (False, [], 1, True),
])
def test_a_storm_of_attempts_without_progress_stops_the_job(progressed: bool | None, before: list[bool],
                                                            after: int, stops: bool) -> None:
    v = Verdict("infrastructure", "rank 1 on n2 was killed", progressed=progressed, start_step=40)
    events = ends(*({"event": "attempt_end", "class": "infrastructure", "progressed": p} for p in before))
    said = storm(v, events, after)
    assert bool(said) == stops, said
    if stops:
        assert "before passing their starting step (step 40)" in str(said)
        assert decide(v, events, Limits(3, 10, Path("/nonexistent"), 1, storm_after=after))[0] == "fail"


@pytest.mark.parametrize(("exc", "kind", "echo"), [
    (RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                  "[127.0.0.1]:3. This is typically caused"), "infrastructure", True),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv"),
     "infrastructure", True),
    (BrokenPipeError("[Errno 32] Broken pipe"), "user_error", False),  # the user's own pipe, not a collective
    (RuntimeError("CUDA error: device-side assert triggered"), "user_error", False),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), "infrastructure", False),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error"), "infrastructure", False),
    (MemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "resource", False),
    (MemoryError(), "resource", False),  # the host's: Python raises it without a message
    (OSError(12, "Cannot allocate memory"), "resource", False),  # a fork (loader workers) the host cannot hold
    (ValueError("shape mismatch"), "user_error", False),
    # the survivors could not go on in place: an echo of the lost rank (whose node srun's line names), no cause
    (RegroupFailed("rank 2 lost and the others could not go on in place (UserError: …)"), "infrastructure", True),
])
def test_classify(exc: Exception, kind: str, echo: bool) -> None:
    info = exits.classify(exc)
    assert (info["class"], info["echo"]) == (kind, echo) and "This is typically" not in info["cause"]


def test_a_user_error_is_recorded_with_its_file_and_line(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text("import trainer\n\ndef main():\n    raise KeyError('vocab')\n\ntrainer.main(main)\n")
    env = clean_env({"RUN_DIR": str(tmp_path / "run"), "SLURMD_NODENAME": "n7", "SLURM_RESTART_COUNT": "2"})
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "KeyError: 'vocab'" in proc.stderr  # the user's traceback stays
    record = json.loads((tmp_path / "run" / "exits" / "local.2" / "train-0.json").read_text())
    assert record["class"] == "user_error" and record["node"] == "n7" and record["where"] == f"{script}:4", record


@pytest.mark.parametrize(("code", "kind"), [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "infrastructure"),  # the OOM-killer, a dying node
    ("import os; os.abort()", "user_error"),  # the script's own crash
    ("raise SystemExit(3)", "user_error"),
    ("raise SystemExit(75)", "preempted"),
    ("pass", "finished"),
])
def test_a_commands_end_is_recorded_by_its_contract(tmp_path: Path, code: str, kind: str) -> None:
    env = clean_env({"RUN_DIR": str(tmp_path), "SLURMD_NODENAME": "n4"})
    subprocess.run([sys.executable, "-m", "trainer.launch", "--", "python", "-c", code], env=env, capture_output=True)
    record = json.loads((tmp_path / "exits" / "local.0" / "train-0.json").read_text())
    assert (record["class"], record["node"]) == (kind, "n4"), record


@pytest.mark.parametrize(("check", "kind", "blame"), [
    ("gpus", "infrastructure", ["n5"]),  # this node's GPUs
    ("fault", "infrastructure", ["n5"]),
    ("model memory", "resource", None),  # the configuration's, on every node alike
    ("tracking", "user_error", None),
])
def test_the_doctor_blames_its_node_only_for_a_node_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check: str,
                                                          kind: str, blame: list[str] | None) -> None:
    from trainer.doctor.checks import FAIL, Check
    from trainer.doctor.run import _record

    for name, value in {"RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRAINER_ATTEMPT", raising=False)
    _record(0, "n5", [Check(check, FAIL, "broken", "")], 1)
    record = json.loads((tmp_path / "exits" / "5.0" / "doctor-0.json").read_text())
    assert (record["class"], record.get("blame")) == (kind, blame), record


@pytest.mark.parametrize("rc", [0, 1, 75, 137])
@pytest.mark.parametrize("marker", [None, "SIGUSR2", "deadline"])
@pytest.mark.parametrize("restarts", [0, 1, 2, 3])
def test_the_shells_fallback_is_the_verdicts_requeue_rule(tmp_path: Path, rc: int, marker: str | None,
                                                          restarts: int) -> None:
    """The one requeue rule for a saved run (cluster/job/rules.py), in Python and as the shell condition the batch
    script falls back to when no verdict can run: the same answer for every exit code, marker and restart count."""
    from cluster.job.rules import RequeueRule

    rule = RequeueRule(max_requeues=2)
    if marker:
        RequeueMarker(marker, 5).write(tmp_path)
    want = rule.requeues(rc == 75 or marker is not None, marker == "deadline", restarts)
    shell = subprocess.run(["bash", "-c", f"rc={rc}; if {rule.shell()}; then echo yes; else echo no; fi"],
                           env={"RUN_DIR": str(tmp_path), "SLURM_RESTART_COUNT": str(restarts), "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True)
    assert shell.stdout.strip() == ("yes" if want else "no"), (shell.stdout, shell.stderr)


@pytest.mark.parametrize(("processes", "said"), [
    ([2], "rank 2"), ([2, 0], "ranks 0, 2"), ([exits.SPARE_BASE], "spare 0"),
    ([1, exits.SPARE_BASE + 1001], "rank 1 and spare 1001"), ([exits.SPARE_BASE + 3, exits.SPARE_BASE], "spares 0, 3"),
    ([], "no process"),
])
def test_processes_are_named_as_ranks_or_warm_spares_by_their_number(processes: list[int], said: str) -> None:
    assert exits.names(processes) == said
