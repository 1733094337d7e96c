"""The typed records a job's processes exchange (trainer/core/records.py, cluster/sweeps/folder.py), read from every
earlier layout: stored examples as earlier versions wrote them (tests/records/), and one from a newer version."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cluster.sweeps.folder import SweepFile
from trainer.core.records import AttemptEnd, ExitRecord, RequeueMarker

STORED = Path(__file__).parent / "records"


def stored(name: str) -> dict[str, object]:
    return dict(json.loads((STORED / name).read_text()))


def test_exit_records_of_an_earlier_layout() -> None:
    ended = ExitRecord.from_json(stored("v0-exit-record.json"))
    assert (ended.rank, ended.node, ended.code, ended.kind, ended.step) == (1, "n2", 1, "user_error", 6)
    assert ended.is_cause and ended.blame is None and ended.describe().startswith("rank 1 on n2: DecodingError")
    started = ExitRecord.from_json(stored("v0-exit-record-started.json"))
    assert not started.ended and not started.is_cause and started.kind is None


def test_requeue_markers_of_both_earlier_writers(tmp_path: Path) -> None:
    shutil.copy(STORED / "v0-requeue-session.json", tmp_path / "requeue.json")
    session = RequeueMarker.read(tmp_path)
    assert session is not None and session.deadline and (session.step, session.by) == (12, None)
    shutil.copy(STORED / "v0-requeue-wrapper.json", tmp_path / "requeue.json")
    wrapper = RequeueMarker.read(tmp_path)
    assert wrapper is not None and not wrapper.deadline
    assert (wrapper.reason, wrapper.by) == ("stopped after the warning signal", "trainer.launch")
    (tmp_path / "requeue.json").write_text("{not json")
    assert RequeueMarker.read(tmp_path) is None


def test_a_marker_written_now_reads_as_the_earlier_verdict_read_it(tmp_path: Path) -> None:
    """A job queued across the upgrade may run the earlier verdict on a marker this version wrote."""
    RequeueMarker("deadline", 7, "/c.pt").write(tmp_path)
    data = json.loads((tmp_path / "requeue.json").read_text())
    assert data["signal"] == "deadline" and data["step"] == 7 and data["schema"] == 1


def test_an_attempt_end_of_an_earlier_layout_knows_it_saved_for_the_deadline() -> None:
    end = AttemptEnd.from_json(stored("v0-attempt-end.json"))
    assert end.deadline and (end.kind, end.decision, end.step) == ("preempted", "requeue", 12)
    newer = stored("v2-attempt-end-from-a-newer-version.json")
    kept = AttemptEnd.from_json(newer)
    assert kept.extra == {"recovered_in_process": True} and kept.kind == "finished"
    again = kept.to_json()
    assert {k: again[k] for k in newer if k != "schema"} == {k: v for k, v in newer.items() if k != "schema"}


def test_a_sweep_file_of_an_earlier_layout(tmp_path: Path) -> None:
    shutil.copy(STORED / "v0-sweep.json", tmp_path / "sweep.json")
    sweep = SweepFile.read(tmp_path)
    assert sweep.arrays == ("31", "35") and sweep.target == 10 and sweep.spec["method"] == "tpe"
    # Typed for its readers (workers, status, report): an earlier layout's missing keys take their defaults (sweep-status
    # died on KeyError 'pruner'), a newer version's unknown ones are left out (a TypeError in every worker).
    assert (sweep.settings.method, sweep.settings.pruner, sweep.settings.max_parallel) == ("tpe", "none", 2)
    assert sweep.but(spec={**sweep.spec, "early_stop": 3}).settings.metric == "test_accuracy"
    sweep.but(target=12).write(tmp_path)
    back = json.loads((tmp_path / "sweep.json").read_text())
    assert back["arrays"] == ["31", "35"] and back["target"] == 12 and back["submitted_at"].startswith("2026-11-25")
