"""What every layer stands on: the environment (frozen facts), the configuration, the process group, errors, atomic
files and the event log. Imports nothing else of the project."""
