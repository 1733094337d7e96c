"""The runtime a training loop runs on: the session (the public API), data loaders and samplers, preemption, hang
watching, tracking, the run folder, FSDP2. Imports ``trainer.core``, ``trainer.checkpoint`` and ``trainer.testing``;
never the built-in trainer or the tools."""
