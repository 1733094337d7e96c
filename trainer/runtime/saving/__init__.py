"""When to save and what a run continues from: signals and the save policy, the auto cadence and the deadline, taking
a save, memory snapshots, the restore."""
