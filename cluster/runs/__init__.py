"""The run tools over the ledger: ``runs``, ``status``, ``logs``, ``cancel``, ``resubmit``."""
