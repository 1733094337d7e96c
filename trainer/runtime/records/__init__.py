"""What a run leaves behind: its folder, result and requeue marker, the attempts and goodput from its event log, W&B, a
sweep trial's reports."""
