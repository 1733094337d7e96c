"""``cluster.task.TrainTask`` and ``CommandTask``: where the submitit tasks of jobs submitted before cluster/ became
packages (3239243) were pickled from; a requeued submitit job unpickles its task by that name, so the names stay (see
docs/architecture.md, "What a batch script calls").
"""

from cluster.launch.task import CommandTask, TrainTask

__all__ = ["CommandTask", "TrainTask"]
