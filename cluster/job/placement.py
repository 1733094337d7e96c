"""Where a job's next attempt runs after a failure: inside its own allocation (a spare node takes over, or a node range
goes on with fewer nodes), or back in the queue without the nodes it blames.

Blame is weighed and fails open (cluster/job/suspects.py): the newest blame is avoided first, older ones are forgotten
first when avoiding them all would leave too few nodes, and a node is used again rather than refusing or failing
the job. Stdlib only (the verdict runs with the host's python3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.job.suspects import fail_open


@dataclass(frozen=True)
class Shape:
    """How many nodes an attempt of this job runs on, and whether its batch script restarts inside the allocation."""

    lo: int
    """The fewest nodes an attempt may run on (a node range's minimum, else the job's node count)."""
    hi: int
    """The most nodes an attempt runs on (the rest of the allocation are spares)."""
    in_place: bool = False
    """The batch script loops: the verdict may start the next attempt here at once (spare nodes, a node range)."""


@dataclass(frozen=True)
class Next:
    """The next attempt's place: here (``release``: nodes given back to Slurm first) or requeued avoiding ``avoid``."""

    here: bool
    avoid: list[str]
    again: list[str] = field(default_factory=list)
    """Blamed nodes used again: avoiding them too would leave fewer nodes than the job needs."""
    release: list[str] = field(default_factory=list)
    nodes: int = 0
    """Nodes of the next attempt (here), or the fewest the requeued job needs."""
    step: list[str] = field(default_factory=list)
    """The very nodes the next attempt runs on (here): what the batch shell passes to srun, nothing else."""

    def describe(self, pool: str) -> str:
        """One line: where, on how many nodes, and any blamed node used again (``pool``: where the nodes come from)."""
        avoid = f" without {', '.join(self.avoid)}" if self.avoid else ""
        given = f"; {', '.join(self.release)} given back to Slurm" if self.release else ""
        again = (f"; {', '.join(self.again)} used again although blamed: avoiding it too would leave fewer than "
                 f"{self.nodes} usable node(s) in {pool}" if self.again else "")
        where = f"here on {self.nodes} node(s)" if self.here else "requeued"
        return f"{where}{avoid}{given}{again}"


def blame_order(current: list[str], earlier: list[list[str]], suspected: list[str], excluded: list[str]) -> list[str]:
    """Nodes to avoid, the most important first: this attempt's blame, the job's earlier blames (newest first), the
    nodes other jobs' evidence avoids (most suspect first), then what the job excluded already."""
    ordered = [*current, *(n for blamed in reversed(earlier) for n in blamed), *suspected, *excluded]
    return list(dict.fromkeys(ordered))


def here(allocation: list[str], ordered: list[str], shape: Shape, current: list[str] | None = None) -> Next | None:
    """The next attempt inside ``allocation`` (the nodes the job holds now, as Slurm says: never one it gave back),
    avoiding ``ordered`` while ``shape.lo`` nodes remain; None when this attempt's blame (``current``, default
    ``ordered[:1]``) cannot be avoided here (then the queue may offer other nodes: a requeued node range starts on as
    many as it may again). An attempt on fewer than ``shape.hi`` nodes (shrinking) gives the nodes it avoids back to
    Slurm: the site can repair them."""
    if not shape.in_place or len(allocation) < shape.lo:
        return None
    avoid, again = fail_open(ordered, set(allocation), shape.lo)
    if set(ordered[:1] if current is None else current) & set(again):
        return None
    left = [n for n in allocation if n not in avoid]
    count = min(len(left), shape.hi)
    release = [n for n in allocation if n in avoid] if len(left) < shape.hi else []
    return Next(True, [n for n in avoid if n in allocation], again, release, count, left[:count])


def queue(ordered: list[str], usable: set[str] | None, need: int) -> Next:
    """The requeued job's exclusions: ``ordered`` as long as ``need`` usable nodes remain (``usable`` None: sinfo
    could not say, so nothing beyond this attempt's blame is avoided and Slurm decides)."""
    if usable is None:
        return Next(False, ordered[:1], nodes=need)
    avoid, again = fail_open(ordered, usable, need)
    return Next(False, avoid, again, nodes=need)
