"""Launching: what a job runs (the built-in trainer or a command), the sbatch script, and the two launchers."""
