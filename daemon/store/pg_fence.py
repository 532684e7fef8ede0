"""Fencing (CONTRACT §13.8): every write of a turn is conditional on this node's lease.

A node registers with a new epoch (pg_coordination.register_node); from then on each
write of a turn (postgres.py) commits only while the node's row has that epoch and its
lease has not run out on the store's clock. A sweeper that fenced the node (a new
epoch) makes every later write of its turns raise Fenced, and the node is told
(`on_fenced`) so it stops those turns. `NodeLease` is that state, shared by the two
stores of one node: the coordination sets it, the Store's writes check it.
"""

from __future__ import annotations

from collections.abc import Callable

from daemon.errors import Fenced
from daemon.store.pg_pool import NOW_MS, Conn

# The writer's lease is current: its node's row has the writer's epoch and its lease has
# not run out. KEY SHARE: a sweeper's fence (an UPDATE of `epoch`, a unique column, so
# it takes the row's FOR UPDATE lock) waits for this transaction, and this one sees the
# fence once it is committed — a turn's write commits before its node is fenced or is
# refused after. The heartbeat's UPDATE of lease_until does not wait for it.
LIVE = (f"SELECT 1 FROM nodes WHERE node_id=%s AND epoch=%s AND lease_until > {NOW_MS} "
        "FOR KEY SHARE")


def guarded(insert_into: str, values: int, returning: str = "1") -> tuple[str, str]:
    """An INSERT of a turn's row, plain and fenced: the fenced one takes its row only
    while the writer's lease is current (LIVE, its lock held to the statement's end),
    so it is one statement either way; no row back means Fenced."""
    marks = ",".join(["%s"] * values)
    return (f"{insert_into} VALUES ({marks}) RETURNING {returning}",
            f"WITH live AS ({LIVE}) {insert_into} SELECT {marks} FROM live "
            f"RETURNING {returning}")


class NodeLease:
    """This node's id and lease epoch, as its store's writes of turns check them."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        # None until the node registers: no write is fenced (not a node yet).
        self.epoch: int | None = None
        # Called (in the Trio thread) each time a write of a turn was refused.
        self.on_fenced: Callable[[], None] | None = None

    def guard(self, conn: Conn) -> None:
        """In a turn's write transaction: refuse it (Fenced) unless this node's lease,
        with its epoch, is current."""
        if self.epoch is not None and conn.execute(
                LIVE, (self.node_id, self.epoch)).fetchone() is None:
            raise Fenced(self.node_id, self.epoch)

    def refused(self) -> None:
        """A write of a turn was refused as Fenced: tell the node."""
        if self.on_fenced is not None:
            self.on_fenced()
