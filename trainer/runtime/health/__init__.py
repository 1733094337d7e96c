"""Whether the ranks are well: hang watching (heartbeat), slow ranks and silent corruption (audit, replay)."""
