"""Fault injection for tests, read from ``TRAINER_FAULTS`` (never part of the public config)."""
