"""Groups of tests that pytest-xdist runs on one worker each (``make test``: ``--dist loadgroup``).

pytest-xdist's own loadgroup puts a test's group into its id from inside the worker, which pytest 9 no longer lets a
plugin do (every test then spreads on its own). Here each worker writes the groups it collected (conftest.py decides
them) into a folder the controller made, and the controller's scheduler reads them: one group, one worker, in order.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ENV = "TRAINER_TEST_GROUPS"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and ENV not in os.environ:  # the controller, or pytest without xdist
        os.environ[ENV] = tempfile.mkdtemp(prefix="test-groups-")  # the workers, started later, inherit it
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(ENV), ignore_errors=True))


def publish(groups: dict[str, str]) -> None:
    """In a worker: tell the controller the group of each test id collected (ungrouped tests are left out)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get(ENV):
        (Path(os.environ[ENV]) / f"{worker}.json").write_text(json.dumps(groups))


def published() -> dict[str, str]:
    """In the controller, once every worker has collected: the group of each test id the workers published."""
    groups: dict[str, str] = {}
    for path in Path(os.environ[ENV]).glob("*.json"):
        groups.update(json.loads(path.read_text()))
    return groups


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with our groups as scopes (a test without a group is a scope of its own)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # asked once every worker has collected, so every file is there
                self.groups = published()
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


class _Workers:
    """The controller's account of each worker: the seconds of its tests by group, and when it reported last. The
    line it prints names the worker that ends last and why, to balance the groups (CLUSTER_SECONDS in conftest.py)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seconds: dict[str, dict[str, float]] = {}
        self.last: dict[str, float] = {}
        self.files: dict[bool, dict[str, float]] = {True: {}, False: {}}
        """The seconds of each file's tests, the dev-cluster files (True) apart from the others."""

    def add(self, report: pytest.TestReport) -> None:
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
        if worker is None:  # not under xdist, or not from a worker
            return
        group = _group_of(report.nodeid)
        by_group = self.seconds.setdefault(worker, {})
        by_group[group] = by_group.get(group, 0.0) + report.duration
        path, files = report.nodeid.split("::")[0], self.files[group != "other"]
        files[path] = files.get(path, 0.0) + report.duration
        self.last[worker] = time.monotonic() - self.start

    def lines(self) -> list[str]:
        out = []
        for worker in sorted(self.last, key=lambda w: -self.last[w]):
            groups = sorted(self.seconds[worker].items(), key=lambda kv: -kv[1])
            shown = ", ".join(f"{g} {s:.0f} s" for g, s in groups[:3])
            out.append(f"{worker}: last result at {self.last[worker]:.0f} s, {sum(s for _, s in groups):.0f} s in "
                       f"tests ({shown})")
        for cluster, what in ((True, "the dev-cluster files' seconds: "), (False, "the other files' seconds (top 15): ")):
            if self.files[cluster]:  # the first: what CLUSTER_SECONDS should say
                files = sorted(self.files[cluster].items(), key=lambda kv: -kv[1])[:None if cluster else 15]
                out.append(what + ", ".join(f'"{f}": {s:.0f}' for f, s in files))
        return out


_GROUPS: dict[str, str] = {}


def _group_of(nodeid: str) -> str:
    if not _GROUPS and os.environ.get(ENV):
        _GROUPS.update(published())
    group = _GROUPS.get(nodeid)
    return group if group and group.startswith("dev-cluster") else "other"


_WORKERS = _Workers()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _WORKERS.add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines = _WORKERS.lines()
    if lines:
        terminalreporter.write_sep("=", "xdist workers, the last to finish first")
        for line in lines:
            terminalreporter.write_line(line)
