"""A sweep's Optuna study: where it lives (a journal file in the sweep folder, or an RDB URL), its sampler and pruner,
its search space, and the trials planned once at submission (random and grid: every worker takes from one plan)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from cluster.sweeps.folder import SweepFile
from cluster.sweeps.spec import SweepSpec, bad, grid, parameter
from cluster.sweeps.storage_url import connect_url, with_env_password
from trainer.core.errors import UserError

JOURNAL = "study.journal"
"""The journal file of a sweep whose storage is ``journal``, in its folder."""

NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "fuse.glusterfs", "glusterfs",
              "fuse.sshfs", "9p", "afs", "panfs", "wekafs", "orangefs", "pvfs2")
"""File systems on which SQLite's locks do not hold across machines."""


def optuna_quiet() -> Any:
    """Optuna, imported when needed (never to list or render), without its per-trial log lines."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is ours to print
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (from /proc/mounts; "" where unknown)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    target = str(path.resolve())
    best = max((m for m in mounts if target == m[0] or target.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=["", ""])
    return best[1]


def check_storage(url: str, sweep_dir: Path) -> None:
    """A storage every worker can share: journal, or an RDB URL whose driver is installed; SQLite not on a network
    file system (its locks do not hold across nodes there)."""
    if url == "journal":
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise bad("storage", f"{url!r} is neither journal nor a database URL",
                   "storage: journal (a file in the sweep folder), or e.g. mysql+pymysql://user:pw@host/db") from None
    if parsed.get_backend_name() == "sqlite":
        db = Path(parsed.database or "").expanduser()
        fs = filesystem(db.parent if db.parent.exists() else sweep_dir)
        if fs in NETWORK_FS or fs.startswith("nfs"):
            raise bad("storage", f"SQLite on {fs} ({db}): its file locks do not hold across nodes, so workers would "
                       "corrupt or lock the study", "storage: journal (safe on shared storage), or an RDB URL")
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        raise bad("storage", f"no database driver is known for {parsed.drivername!r}",
                   "e.g. mysql+pymysql://user:pw@host/db or postgresql://user:pw@host/db, or storage: journal") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise bad("storage", f"the driver for {parsed.drivername} is not installed ({exc})",
                   f"pip install {getattr(exc, 'name', None) or 'the driver'} into this venv") from None


def storage(url: str, sweep_dir: Path) -> Any:
    """The study's storage object: a journal file in ``sweep_dir``, or the RDB URL as Optuna takes it."""
    if url != "journal":
        return optuna_quiet().storages.RDBStorage(url)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(sweep_dir / JOURNAL)))


def space(spec: SweepSpec) -> dict[str, Any]:
    """The parameters as Optuna distributions, in the spec's order."""
    d = optuna_quiet().distributions
    out: dict[str, Any] = {}
    for key, value in spec.parameters.items():
        p = parameter(spec, key, value)
        if p["type"] == "categorical":
            out[key] = d.CategoricalDistribution(p["choices"])
        elif p["type"] == "int":
            out[key] = d.IntDistribution(p["low"], p["high"], log=p["log"], step=p.get("step", 1))
        else:
            out[key] = d.FloatDistribution(p["low"], p["high"], log=p["log"], step=p.get("step"))
    return out


def sampler(spec: SweepSpec, seed: int) -> Any:
    """The spec's sampler with ``sampler_args``; a bad argument is the user's error, named."""
    samplers = optuna_quiet().samplers
    kind = {"tpe": samplers.TPESampler, "random": samplers.RandomSampler, "grid": samplers.RandomSampler,
            "cmaes": samplers.CmaEsSampler}[spec.method]
    return _build("sampler_args", kind, spec.sampler_args, seed=seed)


def pruner(spec: SweepSpec) -> Any:
    """The spec's pruner with ``pruner_args`` (none: Optuna's NopPruner)."""
    pruners = optuna_quiet().pruners
    kind = {"none": pruners.NopPruner, "median": pruners.MedianPruner, "asha": pruners.SuccessiveHalvingPruner,
            "hyperband": pruners.HyperbandPruner}[spec.pruner]
    return _build("pruner_args", kind, spec.pruner_args)


def _build(field: str, kind: Any, args: dict[str, Any], **fixed: Any) -> Any:
    if "seed" in args:
        raise bad(f"{field}.seed", "is the sweep's seed", "set seed: at the top of the spec")
    try:
        return kind(**args, **fixed)
    except (TypeError, ValueError) as exc:
        raise bad(field, f"{kind.__name__} refused {args}: {exc}", "see Optuna's documentation of "
                   f"{kind.__name__} for its arguments") from None


class Trials:
    """A study with its storage: trials by number through the storage's public methods (optuna.storages.BaseStorage),
    for what a study has no method for: re-attaching to a running trial after a requeue, failing one as lost."""

    def __init__(self, study: Any, store: Any) -> None:
        self.study, self.storage = study, store
        self.study_id = store.get_study_id_from_name(study.study_name)

    def _id(self, number: int) -> int:
        return int(self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number))

    def frozen(self, number: int) -> Any:
        """Trial ``number`` as it stands (an optuna FrozenTrial)."""
        return self.storage.get_trial(self._id(number))

    def live(self, number: int) -> Any:
        """Trial ``number`` as a running optuna Trial, to report to and ask about pruning."""
        return optuna_quiet().trial.Trial(self.study, self._id(number))

    def set_attr(self, number: int, key: str, value: Any) -> None:
        self.storage.set_trial_user_attr(self._id(number), key, value)

    def fail(self, number: int, key: str, why: str) -> bool:
        """Fail trial ``number`` with ``why`` under attribute ``key``; False when another process (a worker, a status
        page) ended it first."""
        optuna = optuna_quiet()
        try:
            self.set_attr(number, key, why)
            self.storage.set_trial_state_values(self._id(number), optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        return True


def open_trials(record: SweepFile, sweep_dir: Path, seed: int = 0) -> Trials:
    """The sweep's study and its storage, the study created on first use (``record``: sweep.json), with its sampler
    seeded by ``seed``."""
    spec = record.settings
    store = storage(connect_url(spec.storage, sweep_dir), sweep_dir)
    study = optuna_quiet().create_study(storage=store, study_name=record.study, sampler=sampler(spec, seed),
                                   pruner=pruner(spec), load_if_exists=True,
                                   direction="maximize" if spec.mode == "max" else "minimize")
    return Trials(study, store)


def open_study(record: SweepFile, sweep_dir: Path, seed: int = 0) -> Any:
    """The sweep's study (see ``open_trials``)."""
    return open_trials(record, sweep_dir, seed).study


def key(params: dict[str, Any]) -> str:
    """A trial's values as one comparable string (1 and 1.0 are one value)."""
    return json.dumps({k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                       for k, v in sorted(params.items())})


def plan(spec: SweepSpec, taken: list[dict[str, Any]], count: int | None) -> list[dict[str, Any]]:
    """Random or grid: the next ``count`` trials (grid: default all left), none repeating one in ``taken``.

    Random draws come from Optuna's RandomSampler seeded with ``seed``, in sequence: a later RESUME continues
    the same sequence, and a repeat is drawn again."""
    seen = {key(p) for p in taken}
    if spec.method == "grid":
        left = [c for c in grid(spec) if key(c) not in seen]
        return left[:count] if count is not None else left
    optuna, dists, out = optuna_quiet(), space(spec), []
    draws = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=spec.seed))
    for _ in range(1000 * (count or 0) + len(taken)):
        t = draws.ask(dists)
        draws.tell(t, 0.0)
        if key(t.params) not in seen:
            seen.add(key(t.params))
            out.append(t.params)
        if len(out) == count:
            return out
    raise bad("trials", f"drew only {len(out)} new distinct trials of {count}", "use fewer trials, or widen the ranges")


def check(spec: SweepSpec, sweep_dir: Path) -> None:
    """What Optuna itself would refuse, now: the storage, the sampler's and the pruner's arguments."""
    check_storage(with_env_password(spec.storage), sweep_dir)
    sampler(spec, spec.seed)
    pruner(spec)
    try:
        space(spec)
    except ValueError as exc:
        raise UserError("sweep.parameters", str(exc), "see cluster/sweeps/example.yaml for the forms a parameter takes"
                        ) from None


def seed_for(spec: SweepSpec, worker: int, asked: int) -> int:
    """A worker's sampler seed for its ``asked``-th trial: each differs, so workers never draw the same start-up trial."""
    return (spec.seed * 1_000_003 + worker * 10_007 + asked) % (2**32)

