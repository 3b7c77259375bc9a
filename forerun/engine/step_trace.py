"""Records, for every step, when each phase began and ended and on which thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TraceEvent:
    name: str  # schedule | prepare | recv (pipeline stages) | forward | sample | update | wait
    step: int
    thread: str
    begin: float  # time.perf_counter seconds
    end: float
    args: dict[str, Any] = field(default_factory=dict)


class StepTrace:
    """An append-only list of spans; cheap enough to leave on in benchmarks.

    Invariant: events are appended by the engine thread only (worker spans arrive inside step outputs),
    so no lock is needed.
    """

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.origin = time.perf_counter()

    def span(self, name: str, step: int, begin: float, end: float | None = None, thread: str | None = None,
             **args: Any) -> None:
        self.events.append(TraceEvent(name, step, thread or threading.current_thread().name, begin,
                                      time.perf_counter() if end is None else end, args))

    def dead_tokens(self) -> int:
        return sum(len(e.args.get("dead_tokens", ())) for e in self.events)

    def spec_totals(self) -> tuple[int, int, int]:
        """(verification steps with drafts, drafts proposed, drafts accepted) over the recorded steps."""
        ups = [e.args for e in self.events if e.name == "update"]
        return (sum(1 for a in ups if a.get("drafted")), sum(a.get("drafted", 0) for a in ups),
                sum(a.get("accepted", 0) for a in ups))

    def busy_fraction(self) -> float:
        """Share of wall time (first to last event) that a worker spent in forward or sample, averaged over
        the worker threads that report spans (one per pipeline stage; one in all other setups)."""
        if not self.events:
            return 0.0
        spans = [e for e in self.events if e.name in ("forward", "sample")]
        workers = len({e.thread for e in spans}) or 1
        busy = sum(e.end - e.begin for e in spans)
        wall = max(e.end for e in self.events) - min(e.begin for e in self.events)
        return busy / wall / workers if wall > 0 else 0.0
