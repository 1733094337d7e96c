"""Optuna sweeps: the spec, the study, the worker array and the worker inside its job, status, report, dashboard;
example specs beside them (``*.yaml``)."""
