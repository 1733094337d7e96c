"""A sweep's worker: one array task running trials one after another until the study has its ``trials``.

The worker's batch script (cluster/sweeps/script.py) calls, in the batch shell:
``next``  re-attach to this worker's RUNNING trial (after a requeue; in a RESUME's array, the one its index ran in an
          array Slurm no longer lists), or ask the study for one; write ``workers/<array>_<w>.sh`` (the trial's
          RUN_DIR and arguments) and ``workers/<array>_<w>.json`` (which trial it runs, the trials it ran);
``relay`` while the trial trains: its intermediate values (``reports.jsonl``, written by ``Session.report``) into the
          study, each step once, and the pruner's answer back (``pruning.json``, read by ``Session.should_prune``);
``end``   after the verdict: tell the study complete, pruned or failed, or (requeued) leave the trial RUNNING.
Liveness comes from Slurm: a RUNNING trial whose worker Slurm no longer lists is failed, and its values run again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from cluster.job import ledger
from cluster.sweeps import study as studies
from cluster.sweeps.folder import SweepFile, log_path
from cluster.sweeps.lost import fail_lost, squeue_states
from cluster.sweeps.spec import SweepSpec, trial_args
from trainer.core.events import read as read_events
from trainer.core.exits import attempt_id
from trainer.core.files import write_json

EXIT_DONE, EXIT_STOP, EXIT_REQUEUED = 3, 4, 10
"""``next``: the study has all its trials; ``next``: this worker's last trials all failed; ``end``: requeued."""

FAILURES_IN_A_ROW = 3
"""A worker whose last trials all failed stops (a broken command fails every trial; one worker's node may be bad)."""


def record_of(sweep_dir: Path) -> SweepFile:
    return SweepFile.read(sweep_dir)


def task_name(worker: int) -> str:
    """This array task's name for its files under ``workers/`` (the batch script's ``$task``): a RESUME's array reuses
    the indexes 0…n-1, and its tasks must neither overwrite the old array's files nor inherit their failures."""
    return f"{os.environ.get('SLURM_ARRAY_JOB_ID') or 'local'}_{worker}"


def _mine(sweep_dir: Path, worker: int) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((sweep_dir / "workers" / f"{task_name(worker)}.json").read_text())
        return data
    except (OSError, ValueError):
        return {"worker": worker, "trial": None, "history": []}


@contextlib.contextmanager
def _lock(folder: Path, stale_s: float = 120.0) -> Any:
    """One worker at a time counts and asks (mkdir is atomic on shared file systems too). The holder leaves a token in
    the lock and removes the lock only while its token is there: a holder that was stopped past ``stale_s`` (its lock
    taken over meanwhile) must not remove the next holder's."""
    path = folder / ".ask.lock"
    token = path / f"{os.uname().nodename}-{os.getpid()}-{time.time_ns()}"
    deadline = time.monotonic() + 600
    while True:
        try:
            path.mkdir()
            token.touch()
            break
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > stale_s:  # its holder died: take it over
                    shutil.rmtree(path)
                    continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} held for 10 min") from None
            time.sleep(0.2)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            token.unlink()  # FileNotFoundError: taken over, the lock is another's now
            path.rmdir()


def _write_assignment(sweep_dir: Path, worker: int, mine: dict[str, Any], trial: Any, spec: SweepSpec,
                      record: SweepFile) -> None:
    run_dir = sweep_dir / "trials" / str(trial.number)
    run_dir.mkdir(parents=True, exist_ok=True)
    args = trial_args(spec, trial.params, record.sweep_id, trial.number)
    name = f"{record.sweep_id}-{trial.number}"
    lines = [f"export RUN_DIR={shlex.quote(str(run_dir))} TRAINER_TRIAL={shlex.quote(name)} "
             f"TRAINER_PRUNING={int(spec.pruner != 'none')}",
             f"set -- {shlex.join(args)}"]
    (sweep_dir / "workers" / f"{task_name(worker)}.sh").write_text("\n".join(lines) + "\n")
    write_json(sweep_dir / "workers" / f"{task_name(worker)}.json",
               {**mine, "trial": trial.number, "run_dir": str(run_dir)})


def next_trial(sweep_dir: Path, worker: int) -> int:
    """Re-attach to this worker's RUNNING trial, or ask for the next one; EXIT_DONE when the study has them all."""
    record, mine = record_of(sweep_dir), _mine(sweep_dir, worker)
    spec = record.settings
    with _lock(sweep_dir / "workers"):
        trials = studies.open_trials(record, sweep_dir, studies.seed_for(spec, worker, len(mine["history"])))
        study = trials.study
        trial = _held(trials, mine, worker)
        if trial is not None:
            # A RESUME's array runs it now: its attributes name this task, or fail_lost would take it for lost.
            for k, v in _owner(worker).items():
                if trial.user_attrs.get(k) != v:
                    trials.set_attr(trial.number, k, v)
            _write_assignment(sweep_dir, worker, mine, trials.live(trial.number), spec, record)
            _record(sweep_dir, worker, record, trial.number, trial.params)  # a RESUME's array holds it now
            print(f"worker {worker}: re-attached to trial {trial.number} {_values(trial.params)} (it resumes from its "
                  f"checkpoint; {len(trial.intermediate_values)} step(s) reported)", file=sys.stderr)
            return 0
        fail_lost(trials, retry=True)
        recent = [h["state"] for h in mine["history"][-FAILURES_IN_A_ROW:]]
        if len(recent) == FAILURES_IN_A_ROW and set(recent) == {"FAIL"}:
            print(f"worker {worker}: its last {FAILURES_IN_A_ROW} trials failed; it stops (their logs: "
                  f"{sweep_dir / 'trials'}/<n>)", file=sys.stderr)
            return EXIT_STOP
        trials = study.get_trials(deepcopy=False)
        waiting = any(t.state.name == "WAITING" for t in trials)
        counted = [t for t in trials if t.state.name != "WAITING" and "lost" not in t.user_attrs]
        if not waiting and len(counted) >= record.target:
            return EXIT_DONE
        trial = study.ask(studies.space(spec))
        for k, v in {**_owner(worker), "run_dir": str(sweep_dir / "trials" / str(trial.number))}.items():
            trial.set_user_attr(k, v)
        _write_assignment(sweep_dir, worker, mine, trial, spec, record)
    _record(sweep_dir, worker, record, trial.number, trial.params)
    print(f"worker {worker}: trial {trial.number} {_values(trial.params)}", file=sys.stderr)
    return 0


def _held(trials: studies.Trials, mine: dict[str, Any], worker: int) -> Any:
    """The RUNNING trial this task goes on with: its own after a requeue or, in a RESUME's array, the one its index
    ran in an array Slurm no longer lists; never one whose worker lives (two jobs would train it in one folder)."""
    if mine.get("trial") is not None:
        trial = trials.frozen(mine["trial"])
        return trial if trial.state.name == "RUNNING" else None
    here = os.environ.get("SLURM_ARRAY_JOB_ID", "")
    left = [t for t in trials.study.get_trials(deepcopy=False) if t.state.name == "RUNNING"
            and t.user_attrs.get("worker") == worker and str(t.user_attrs.get("array") or here) != here]
    alive = squeue_states(sorted({str(t.user_attrs["array"]) for t in left})) if left else None
    if alive is None:  # none left, or squeue cannot answer: nothing may be concluded
        return None
    return next((t for t in left if (str(t.user_attrs["array"]), worker) not in alive), None)


def _owner(worker: int) -> dict[str, Any]:
    """The trial attributes that name the array task running it (fail_lost asks Slurm whether that task lives)."""
    return {"worker": worker, "array": os.environ.get("SLURM_ARRAY_JOB_ID", ""), "job": os.environ.get("SLURM_JOB_ID", "")}


def _record(sweep_dir: Path, worker: int, record: SweepFile, number: int, params: dict[str, Any]) -> None:
    """The trial in the ledger (``python -m cluster runs --trials``), under its worker's array task."""
    name, task = f"{record.sweep_id}-{number}", task_name(worker)  # its worker's files are workers/<task>.*
    try:
        ledger.write(ledger.Record(kind="trial", key=name, name=name, trial=number, worker=worker, job_id=task,
                                   sweep_dir=str(sweep_dir), run_dir=str(sweep_dir / "trials" / str(number)),
                                   params=params, launcher="sweep", log=str(log_path(sweep_dir, task))))
    except OSError as err:
        print(f"worker {worker}: could not record trial {number} in the ledger: {err}", file=sys.stderr)


def _values(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def relay(sweep_dir: Path, worker: int, once: bool = False, poll_s: float = 1.0) -> int:
    """Copy the trial's new intermediate values into the study (a step already there is skipped: a resumed trial
    reports its replayed steps again) and write the pruner's answer for the last one to ``pruning.json``."""
    record, mine = record_of(sweep_dir), _mine(sweep_dir, worker)
    if mine.get("trial") is None:
        return 0

    spec = record.settings
    trials = studies.open_trials(record, sweep_dir)
    trial = trials.live(mine["trial"])
    run_dir, offset = Path(mine["run_dir"]), 0
    reported = set(trials.frozen(mine["trial"]).intermediate_values)
    parent = os.getppid()
    while True:
        # The trial has ended (its result, or the worker went on to another) or the worker is gone: one last pass.
        last = once or os.getppid() != parent or (run_dir / "result.json").exists() \
            or _mine(sweep_dir, worker).get("trial") != mine["trial"]
        offset, rows = _new_lines(run_dir / "reports.jsonl", offset)
        for row in rows:
            step, value = _step_value(row, spec.metric)
            if step is None:
                _unusable(row, spec.metric, run_dir)
                continue
            if step not in reported:
                trial.report(float(value), step)
                reported.add(step)
            prune = spec.pruner != "none" and trial.should_prune()
            write_json(run_dir / "pruning.json", {"step": step, "prune": bool(prune)})
        if last:
            return 0
        time.sleep(poll_s)


def _step_value(row: Any, metric: str) -> tuple[int | None, float]:
    """A report's step and its finite value of ``metric`` (``value``, or ``values[metric]``); no step when the line
    holds no such thing (it may be any JSON: a command writes the file itself)."""
    values = row.get("values") if isinstance(row, dict) else None
    value = row.get("value") if isinstance(row, dict) and "value" in row else \
        values.get(metric) if isinstance(values, dict) else None
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(value, int | float) \
            or isinstance(value, bool) or not math.isfinite(value):
        return None, math.nan
    return step, float(value)


_SAID: set[Path] = set()


def _unusable(row: Any, metric: str, run_dir: Path) -> None:
    """Once per trial: a report the pruner cannot use (no step, or no finite value of the sweep's metric)."""
    if run_dir not in _SAID:
        _SAID.add(run_dir)
        print(f"sweep worker: {run_dir / 'reports.jsonl'}: a report without a step or a finite {metric} ({row}): "
              f"the pruner skips it; report(step, {{'{metric}': value}}) or the value itself", file=sys.stderr)


def _new_lines(path: Path, offset: int) -> tuple[int, list[Any]]:
    """Whole JSON lines of ``path`` after ``offset`` (a line still being written waits for the next look)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset, []
    whole = data[: data.rfind(b"\n") + 1]
    rows = []
    for line in whole.splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return offset + len(whole), rows


def end(sweep_dir: Path, worker: int, rc: int) -> int:
    """Tell the study how the trial ended; EXIT_REQUEUED when the verdict requeued the job (the trial stays RUNNING)."""
    mine = _mine(sweep_dir, worker)
    if mine.get("trial") is None:
        return 0
    run_dir, number = Path(mine["run_dir"]), mine["trial"]
    job = os.environ.get("SLURM_JOB_ID", "0")
    verdicts = [e for e in read_events(run_dir) if e.get("event") == "attempt_end" and e.get("job_id") == job
                and str(e.get("attempt")) == attempt_id()]  # this attempt's verdict, not an earlier one's
    if verdicts and verdicts[-1].get("decision") in ("requeue", "restart_here"):
        print(f"worker {worker}: trial {number} requeued with this job; it resumes when the job starts again",
              file=sys.stderr)
        return EXIT_REQUEUED
    relay(sweep_dir, worker, once=True)  # what the trial reported after the relay's last look
    record = record_of(sweep_dir)
    spec = record.settings
    state, value, why = _outcome(run_dir, rc, spec.metric)
    trials = studies.open_trials(record, sweep_dir)
    study = trials.study
    TrialState = studies.optuna_quiet().trial.TrialState
    try:
        if state == "COMPLETE":
            study.tell(number, value)
        else:
            trials.set_attr(number, "cause", why)  # before: a finished trial is frozen
            study.tell(number, state=getattr(TrialState, state))
    except (RuntimeError, ValueError) as exc:  # finished already (failed as lost while this worker was cut off)
        print(f"worker {worker}: trial {number} was already ended in the study ({exc})", file=sys.stderr)
    shown = f"{spec.metric} {value:.6g}" if value is not None else why
    print(f"worker {worker}: trial {number} {state.lower()}: {shown}", file=sys.stderr)
    write_json(sweep_dir / "workers" / f"{task_name(worker)}.json",
               {**mine, "trial": None, "history": [*mine["history"], {"trial": number, "state": state}]})
    return 0


def _outcome(run_dir: Path, rc: int, metric: str) -> tuple[str, float | None, str]:
    """(COMPLETE|PRUNED|FAIL, the metric, why) from the trial's result.json and the tasks' exit code."""
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return "FAIL", None, f"the tasks exited {rc} without a result.json"
    if result.get("outcome") == "pruned":
        return "PRUNED", None, f"pruned at step {result.get('global_step')}"
    if rc or result.get("outcome", "finished") != "finished":  # a command's own result.json may say nothing of it
        return "FAIL", None, str(result.get("reason") or result.get("cause") or f"the tasks exited {rc}")
    value = result.get(metric)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return "FAIL", None, f"result.json has no finite {metric} (keys: {', '.join(sorted(result))})"
    return "COMPLETE", float(value), ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.sweeps.worker", description=__doc__)
    p.add_argument("action", choices=("next", "relay", "end"))
    p.add_argument("sweep_dir", type=Path)
    p.add_argument("--worker", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", "0")))
    p.add_argument("--rc", type=int, default=0, help="end: the tasks' exit code")
    ns = p.parse_args(argv)
    if ns.action == "next":
        return next_trial(ns.sweep_dir, ns.worker)
    if ns.action == "relay":
        return relay(ns.sweep_dir, ns.worker)
    return end(ns.sweep_dir, ns.worker, ns.rc)


if __name__ == "__main__":
    sys.exit(main())
