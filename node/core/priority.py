"""Request priority (``priority``, lower first, under ``--scheduling-policy priority``): the one order
rule every queue of the node keeps (pure: no I/O).

A queue holds its items in ``(priority, arrival)`` order: an item goes after every item of the same or
a better (lower) priority, so equal priorities keep their arrival order and, under first-come-first-
served (every priority 0), a queue is exactly its arrival order. The batcher's waiting list orders by
:meth:`node.core.sequence.Sequence.sort_key` (priority first), the role policies by
:meth:`node.core.role_state.WaitingPrompt.order_key`, and the drivers' pending lists by
:func:`insert_by_priority`.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def insert_by_priority(queue: list[T], item: T, priority_of: Callable[[T], int]) -> int:
    """Insert ``item`` into ``queue`` (kept in priority order, arrival order within a priority) after
    every item whose priority is not worse than its own; returns its position. O(items passed over):
    appending (the common case, equal priorities) is O(1)."""
    p = priority_of(item)
    pos = len(queue)
    while pos > 0 and priority_of(queue[pos - 1]) > p:
        pos -= 1
    queue.insert(pos, item)
    return pos
