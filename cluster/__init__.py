"""Submission to Slurm clusters: profiles and the submitit launcher."""
