"""The job's own bookkeeping, run inside the allocation by the batch shell: the verdict on an attempt, what Slurm says of
its nodes, the suspect nodes, where the next attempt runs, the ledger. Standard library only (and trainer.core)."""
