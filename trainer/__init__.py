"""DDP training that runs the same on a laptop, under torchrun, and on Slurm nodes."""

__version__ = "0.1.0"
