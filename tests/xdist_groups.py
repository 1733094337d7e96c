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


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with our groups as scopes (a test without a group is a scope of its own)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # asked once every worker has collected, so every file is there
                self.groups = {}
                for path in Path(os.environ[ENV]).glob("*.json"):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)
