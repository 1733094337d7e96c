"""The built-in trainer (``python -m trainer``): targets, data sets, models, tasks, metrics and the training loop,
written on the public session API like any user's loop."""
