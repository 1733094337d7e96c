"""The ledger's typed record: records written by earlier versions (stored examples, tests/ledger_records/) still read,
each as the run tools need it, and survive a rewrite (``cancel`` writes a record back) with nothing lost."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.job import ledger
from cluster.job.ledger import SCHEMA, Record
from cluster.runs import logs

STORED = Path(__file__).parent / "ledger_records"

# file → (kind, job ids, launcher, one log file per task, the command or None, args)
EXPECTED = {
    "v0-sbatch-job.json": ("job", ["28435785"], "sbatch", False, None, 11),
    "v0-submitit-job.json": ("job", ["28435790"], "submitit", True, None, 1),
    "v0-command.json": ("job", ["61"], "sbatch", False, ("python", "t.py"), 2),
    "v0-by-hand.json": ("job", ["8"], "sbatch", False, None, 1),
    "v0-sweep.json": ("sweep", ["31", "35"], "sweep", False, None, 0),
    "v0-trial.json": ("trial", ["31_1"], "sweep", False, None, 0),
    "v2-from-a-newer-version.json": ("job", ["40"], "sbatch", False, None, 0),
}


def test_every_stored_example_is_covered() -> None:
    assert sorted(p.name for p in STORED.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_stored_record_reads_and_survives_a_rewrite(name: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.loads((STORED / name).read_text())
    record = Record.from_json(data)
    kind, ids, launcher, task_logs, command, n_args = EXPECTED[name]
    assert (record.kind, record.ids(), record.launcher, record.task_logs, record.command, len(record.args)) == \
        (kind, ids, launcher, task_logs, command, n_args)
    assert record.submitted_at == data["submitted_at"] and record.run_dir == data["run_dir"]
    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path))
    ledger.write(replace(record, cancelled_at=1.5))  # what `cancel` does
    (again,) = ledger.records()
    assert again == replace(record, cancelled_at=1.5, schema=SCHEMA)
    written = json.loads(next(tmp_path.glob("*.json")).read_text())
    # Nothing of the old record is lost: every key comes back with its value (lists as lists, the schema added).
    kept = {k: v for k, v in data.items() if v is not None and k != "schema"}
    assert {k: written.get(k) for k in kept} == kept
    assert written["schema"] == SCHEMA and written["cancelled_at"] == 1.5


def test_a_newer_versions_keys_are_kept_and_a_submitit_jobs_logs_are_its_tasks_files(tmp_path: Path) -> None:
    newer = Record.from_json(json.loads((STORED / "v2-from-a-newer-version.json").read_text()))
    assert newer.extra == {"priority_hint": "low"} and newer.to_json()["priority_hint"] == "low"
    old = Record.from_json(json.loads((STORED / "v0-submitit-job.json").read_text()))
    old = replace(old, log=str(tmp_path))
    (tmp_path / "28435790_0_log.out").write_text("")
    (tmp_path / "28435790_1_log.out").write_text("")
    assert [p.name for p in logs.files(old, 1)] == ["28435790_1_log.out"]  # the layout follows its launcher


@pytest.mark.parametrize("data", [{}, {"kind": "job"}, [1, 2], {"job_id": ""}])
def test_what_is_not_a_record_is_refused_as_such(data: object) -> None:
    with pytest.raises(ValueError):
        Record.from_json(data)  # type: ignore[arg-type]
