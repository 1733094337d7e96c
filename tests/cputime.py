"""``TRAINER_TEST_CPU=1 make test``: each test's CPU seconds (its own, its processes', and those forked for it by
the warm server, tests/warm/), the costliest listed at the end. On 2 cores the suite's wall time follows its CPU time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import warm

GROUP = os.environ.get("TRAINER_TEST_CPU_CGROUP", "")
"""A cpuacct cgroup folder whose CPU counts too: the daemons' (.ci/run's lanes), so that a cluster test's jobs count.
Only one test may use those daemons at a time for its figure to be its own (one dev cluster, one worker)."""


def _cpu() -> float:
    t = os.times()
    group = int(Path(GROUP, "cpuacct.usage").read_text()) / 1e9 if GROUP else 0.0
    return t.user + t.system + t.children_user + t.children_system + warm.children_cpu() + group


@pytest.fixture(autouse=True)
def _cpu_seconds(request: pytest.FixtureRequest) -> Iterator[None]:
    start = _cpu()
    yield
    request.node.user_properties.append(("cpu_s", _cpu() - start))


SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    cpu = dict(report.user_properties).get("cpu_s")
    if report.when == "teardown" and cpu is not None:  # under xdist: the workers' reports, here in the controller
        SPENT[report.nodeid] = float(cpu)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_sep("=", f"CPU seconds: {sum(SPENT.values()):.0f} in all; the costliest 40")
    for nodeid, cpu in sorted(SPENT.items(), key=lambda kv: -kv[1])[:int(os.environ.get("TRAINER_TEST_CPU_TOP", "40"))]:
        terminalreporter.write_line(f"{cpu:7.1f}  {nodeid}")
