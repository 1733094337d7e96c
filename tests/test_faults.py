"""The test faults' spec (trainer/testing/faults.py): words for every attempt, and words for one attempt only."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.core.errors import UserError
from trainer.testing.faults import Faults, load


@pytest.mark.parametrize(("spec", "attempt", "expected"), [
    ("", "0", Faults()),
    ("kill_at_step=4 step_delay_s=0.5", "1", Faults(kill_at_step=4, step_delay_s=0.5)),
    ("0:kill_at_step=4 0.1:hang_at_step=3 1:preempt_at_step=2", "0", Faults(kill_at_step=4)),
    ("0:kill_at_step=4 0.1:hang_at_step=3 1:preempt_at_step=2", "0.1", Faults(hang_at_step=3)),
    ("0:kill_at_step=4 0.1:hang_at_step=3 1:preempt_at_step=2", "1", Faults(preempt_at_step=2)),
    ("0:kill_at_step=4 0.1:hang_at_step=3 1:preempt_at_step=2", "2", Faults()),
    ("step_delay_s=0.3 0:kill_at_step=4 0:kill_rank=0", "0", Faults(step_delay_s=0.3, kill_at_step=4, kill_rank=0)),
    ("step_delay_s=0.3 0:kill_at_step=4 0:kill_rank=0", "0.1", Faults(step_delay_s=0.3)),
    ("ledger=/a:b/c", "0", Faults(ledger="/a:b/c")),  # a colon in a value is no attempt
    ("kill_at_step=4 only_restart=0", "0.1", Faults()),  # the older spelling: every fault in that attempt only
])
def test_words_apply_in_every_attempt_or_in_the_one_they_name(spec: str, attempt: str, expected: Faults) -> None:
    assert load(spec, attempt) == expected


@pytest.mark.parametrize("spec", ["kill_at=4", "1:kill_at=4", "kill_at_step=four"])
def test_a_misspelt_fault_is_an_error_in_every_attempt(spec: str) -> None:
    with pytest.raises(UserError) as caught:
        load(spec, "0")
    assert caught.value.field == "TRAINER_FAULTS"


def test_a_process_holds_at_its_first_and_second_wait_under_names_of_their_own(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_at_step=1 wait_again_at_step=3: held after this process's steps 2 and 4 (the second as ``0-again``, which
    a group gone on in place, still attempt 0 to its processes, is released by), never at another step."""
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.delenv("TRAINER_ATTEMPT", raising=False)
    faults, seen = load("wait_at_step=1 wait_again_at_step=3", "0"), []
    for done in range(6):
        faults.wait(done, 1, tmp_path, lambda: None, lambda: True)  # a signal: released at once
        seen.append(sorted(p.name for p in (tmp_path / "faults").glob("waiting.*")) if (tmp_path / "faults").exists()
                    else [])
    assert seen == [[], [], ["waiting.0.1"], ["waiting.0.1"], ["waiting.0-again.1", "waiting.0.1"],
                    ["waiting.0-again.1", "waiting.0.1"]]
