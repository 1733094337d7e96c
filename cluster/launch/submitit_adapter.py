"""Everything that touches submitit's internals, in one place (tests/test_submitit_adapter.py pins each of them,
and pyproject.toml bounds submitit to the releases that test has passed on).

submitit has no public way to print the batch script it would submit, nor to build its Slurm executor where Slurm
is not installed; dry runs and golden-file tests need both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def renderable() -> Iterator[None]:
    """Let submitit's Slurm executor be built where Slurm is not installed, to print its script (dry runs).

    Its constructor asks ``SlurmExecutor.affinity()``, which runs ``srun``, though rendering never does.
    """
    from submitit.slurm.slurm import SlurmExecutor

    original = SlurmExecutor.__dict__["affinity"]
    SlurmExecutor.affinity = classmethod(lambda cls: 1)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        SlurmExecutor.affinity = original  # type: ignore[method-assign]


def submission_text(auto_executor: Any) -> str:
    """The batch script an ``AutoExecutor`` for Slurm would submit (its job's uid shown as ``<uid>``)."""
    inner = auto_executor._executor
    return str(inner._make_submission_file_text(inner._submitit_command_str, "<uid>"))
