"""Growing back at a step boundary: a group that went on smaller (a rank lost, no spare then) takes in warm spares
that came since (a replacement started on a node that came back), at a poll, with no rank lost.

``Growth`` rides on the poll: rank 0 asks the store whether spares wait (only while the group is smaller than the
job's first), the ranks agree, and ``Session.should_save`` raises ``Grow`` into the loop's ``except RuntimeError``,
whose ``Session.regroup`` forms the next generation with the spares in it (``runtime/recovery.py``).
"""

from __future__ import annotations

from trainer.core.regroup import Membership
from trainer.runtime.poll import Layout, Message


class Growth:
    """A poll part: whether the ranks grow back at this step (``due``)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.due = False

    def register(self, layout: Layout) -> None:
        self.field = layout.add("warm spares to grow by")

    def send(self, message: Message, step: int) -> None:
        message.put(self.field, 1.0 if message.rank == 0 and self.membership.can_grow() else 0.0)

    def receive(self, message: Message, step: int) -> None:
        self.due = message.get(self.field) > 0
