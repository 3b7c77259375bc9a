"""Queue orders for the scheduling policy: first come first served, or by per-request priority."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Literal

from forerun.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float]:
    """Lower priority values run first; among equals, the earlier arrival."""
    return (req.priority, req.arrival_time)


class PriorityQueue:
    """Waiting requests kept sorted by `priority_key`, behind the part of deque's interface the scheduler uses.

    Invariant: iteration and `[0]` follow the key order whatever the insertion call, so a preempted request
    (`appendleft`) goes back to its own place rather than jumping ahead of higher-priority ones; equal keys
    keep insertion order.
    """

    def __init__(self) -> None:
        self._items: list[Request] = []

    def append(self, req: Request) -> None:
        bisect.insort_right(self._items, req, key=priority_key)

    appendleft = append

    def extendleft(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.append(req)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, req: object) -> bool:
        return req in self._items


def make_waiting_queue(policy: str) -> deque[Request] | PriorityQueue:
    return PriorityQueue() if policy == "priority" else deque()


def add_running(running: list[Request], req: Request, policy: str) -> None:
    """Admit `req` to the running list. Under priority the list stays in key order, so the scheduler's
    preemption victim, the list's last entry, is the lowest-priority request (ties: the latest arrival)
    and is never one already given tokens earlier in the same pass."""
    if policy == "priority":
        bisect.insort_right(running, req, key=priority_key)
    else:
        running.append(req)


def validate_scheduling_policy(policy: object) -> None:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy: expected fcfs or priority, got {policy!r}")


def check_priority(priority: object, policy: str) -> None:
    """ValueError naming `priority` for a non-integer, or a non-zero value the fcfs policy would ignore."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority: got {priority} but priority scheduling is off; start the engine with "
                         "scheduling_policy='priority' (--scheduling-policy priority)")
