"""The cluster side: launch jobs on Slurm, keep their books inside the allocation, show runs, run sweeps.

``profile``  the site profile (a YAML file: partition, resources, container, launcher)
``job``      what runs inside the allocation around the ranks: verdict, nodes, suspects, placement, ledger
``launch``   what is submitted (a built-in run or a command) and the two launchers (sbatch, submitit)
``runs``     the run tools over the ledger: runs, status, logs, cancel, resubmit
``sweeps``   Optuna sweeps: spec, study, the worker array, the worker inside its job, status and report
``__main__`` the one command line (``python -m cluster …``)
"""
