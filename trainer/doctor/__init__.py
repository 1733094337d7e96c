"""``python -m trainer.doctor``: preflight checks on every rank (GPUs, rendezvous, run folder, all-reduce, W&B)."""
