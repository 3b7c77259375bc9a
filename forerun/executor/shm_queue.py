"""A single-producer / multi-consumer broadcast queue in shared memory, plus a latency benchmark.

The ring holds `n_slots` fixed-size slots. Each slot starts with a small header:

    [written: 1 byte][read flag per reader: n_readers bytes][overflow: 1 byte][pad][length: 8 bytes]

The writer fills a slot only when every reader has read it (or it was never written), clears the read
flags and sets `written` last; a reader takes the slot when `written` is set and its own flag is not,
unpickles the payload and then sets its flag. Because every party walks the slots in the same order,
messages arrive in order and each reader sees every message exactly once.

A payload larger than a slot travels in a side segment of its own size, whose name the slot carries;
the writer unlinks it once every reader has read the slot (or on close). Nothing is ever truncated.

Readers must run in the creating process or in processes it started (spawn or fork): they then share
its resource tracker, so attaching to a segment never schedules it for deletion twice.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import statistics
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

_LEN = struct.Struct("<Q")
_EMPTY = object()


class QueueTimeout(TimeoutError):
    """No slot became available (put) or no message arrived (get) within the timeout."""


@dataclass(frozen=True)
class ShmQueueHandle:
    """Everything another process needs to attach to a ring (picklable)."""

    name: str
    n_readers: int
    n_slots: int
    slot_bytes: int

    @property
    def meta_bytes(self) -> int:
        return -(-(2 + self.n_readers) // 8) * 8 + _LEN.size

    @property
    def stride(self) -> int:
        return self.meta_bytes + self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.stride * self.n_slots


class ShmBroadcastQueue:
    """Owns the ring's shared-memory segment: creates it zeroed and unlinks it on `close()`.

    Invariant: the segment exists from construction until `close()`; writers and readers attach through
    `handle`, in this process or in processes it started.
    """

    def __init__(self, n_readers: int, n_slots: int = 8, slot_bytes: int = 1 << 20) -> None:
        if n_readers < 1:
            raise ValueError(f"n_readers: must be >= 1, got {n_readers}")
        if n_slots < 1:
            raise ValueError(f"n_slots: must be >= 1, got {n_slots}")
        if slot_bytes < 64:
            raise ValueError(f"slot_bytes: must be >= 64, got {slot_bytes}")
        name = f"forerun-{uuid.uuid4().hex[:16]}"
        probe = ShmQueueHandle(name, n_readers, n_slots, slot_bytes)
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=name, create=True, size=probe.total_bytes)
        self._shm.buf[:probe.total_bytes] = bytes(probe.total_bytes)
        self.handle = probe

    def close(self) -> None:
        shm = self._shm
        if shm is None:
            return
        shm.close()
        try:
            shm.unlink()
        except FileNotFoundError:
            # A close that a signal cut short (a SIGTERM during the engine's orderly shutdown) removed the
            # segment but not the resource tracker's record of it, which would report it as leaked.
            resource_tracker.unregister(f"/{shm.name}", "shared_memory")
        self._shm = None


class _Waiter:
    """Spin for `spin_s` (lowest latency when the peer is quick), yielding the core on every turn so a
    spinning party never starves a runnable one on a small machine, then sleep with a growing back-off
    so an idle party costs almost no CPU."""

    def __init__(self, spin_s: float, max_sleep_s: float) -> None:
        self.spin_s = spin_s
        self.max_sleep_s = max_sleep_s

    def wait(self, ready, timeout: float | None) -> None:
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        sleep = 10e-6
        while not ready():
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(f"no progress within {timeout} s")
            if now - start < self.spin_s:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, self.max_sleep_s)


class _Attached:
    def __init__(self, handle: ShmQueueHandle, spin_s: float, max_sleep_s: float) -> None:
        self.h = handle
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(name=handle.name)
        self.buf = self._shm.buf
        self.index = 0
        self._waiter = _Waiter(spin_s, max_sleep_s)
        # Lock acquire/release is a full memory barrier in practice: it orders the payload writes before
        # the flag write on weakly ordered CPUs (on x86 the stores are already ordered).
        self._fence_lock = threading.Lock()

    def _fence(self) -> None:
        with self._fence_lock:
            pass

    def _slot(self, i: int) -> int:
        return i * self.h.stride

    def close(self) -> None:
        if self._shm is not None:
            self.buf.release()
            self._shm.close()
            self._shm = None


class ShmWriter(_Attached):
    """The one producer of a ring. `put` blocks while the next slot is still unread by some reader.

    Invariant: a slot's `written` byte is set only after its payload, length and cleared read flags are
    in place; a side segment lives until every reader has read its slot.
    """

    def __init__(self, handle: ShmQueueHandle, spin_s: float = 2e-3, max_sleep_s: float = 500e-6) -> None:
        super().__init__(handle, spin_s, max_sleep_s)
        self._side: dict[int, shared_memory.SharedMemory] = {}

    def _free(self, base: int) -> bool:
        h, buf = self.h, self.buf
        if buf[base] == 0:
            return True
        return buf[base + 1: base + 1 + h.n_readers] == b"\x01" * h.n_readers

    def put(self, obj: Any, timeout: float | None = None) -> None:
        self.put_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), timeout)

    def put_bytes(self, data: bytes, timeout: float | None = None) -> None:
        h, buf = self.h, self.buf
        base = self._slot(self.index)
        self._waiter.wait(lambda: self._free(base), timeout)
        self._fence()
        buf[base] = 0
        old = self._side.pop(self.index, None)
        if old is not None:  # every reader has read it: the side segment can go
            old.close()
            old.unlink()
        data_at = base + h.meta_bytes
        overflow = len(data) > h.slot_bytes
        if overflow:
            side = shared_memory.SharedMemory(name=f"{h.name}-{uuid.uuid4().hex[:8]}", create=True,
                                              size=len(data))
            side.buf[:len(data)] = data
            self._side[self.index] = side
            ref = side.name.encode()
            buf[data_at:data_at + len(ref)] = ref
            payload_len = len(ref)
        else:
            buf[data_at:data_at + len(data)] = data
            payload_len = len(data)
        len_at = data_at - _LEN.size
        buf[len_at:data_at] = _LEN.pack(payload_len)
        buf[base + 1 + h.n_readers] = 1 if overflow else 0
        buf[base + 1: base + 1 + h.n_readers] = bytes(h.n_readers)
        self._fence()
        buf[base] = 1
        self.index = (self.index + 1) % h.n_slots

    def close(self) -> None:
        for side in self._side.values():
            side.close()
            try:
                side.unlink()
            except FileNotFoundError:
                pass
        self._side.clear()
        super().close()


class ShmReader(_Attached):
    """Consumer number `reader` of a ring: sees every message once, in the order it was put."""

    def __init__(self, handle: ShmQueueHandle, reader: int, spin_s: float = 2e-3,
                 max_sleep_s: float = 500e-6) -> None:
        if not 0 <= reader < handle.n_readers:
            raise ValueError(f"reader: must be in [0, {handle.n_readers}), got {reader}")
        super().__init__(handle, spin_s, max_sleep_s)
        self.reader = reader

    def _ready(self, base: int) -> bool:
        return self.buf[base] == 1 and self.buf[base + 1 + self.reader] == 0

    def get(self, timeout: float | None = None) -> Any:
        base = self._slot(self.index)
        self._waiter.wait(lambda: self._ready(base), timeout)
        return self._take(base)

    def try_get(self) -> Any:
        """The next message, or `EMPTY` (this module's sentinel) when none is waiting."""
        base = self._slot(self.index)
        return self._take(base) if self._ready(base) else _EMPTY

    def _take(self, base: int) -> Any:
        h, buf = self.h, self.buf
        self._fence()
        data_at = base + h.meta_bytes
        (n,) = _LEN.unpack(buf[data_at - _LEN.size:data_at])
        try:
            if buf[base + 1 + h.n_readers]:
                side = shared_memory.SharedMemory(name=bytes(buf[data_at:data_at + n]).decode())
                try:
                    with side.buf as view:
                        return pickle.loads(view)
                finally:
                    side.close()
            with buf[data_at:data_at + n] as view:
                return pickle.loads(view)
        finally:
            self._fence()
            buf[base + 1 + self.reader] = 1
            self.index = (self.index + 1) % h.n_slots


EMPTY = _EMPTY


# ---- micro benchmark -----------------------------------------------------------------------------
def _bench_reader(rank: int, handle: ShmQueueHandle, mpq, results) -> None:
    """Receive every message of both phases; report one-way latencies (seconds) per message."""
    reader = ShmReader(handle, rank)
    shm_lat = []
    while (msg := reader.get(timeout=60)) is not None:
        shm_lat.append(time.perf_counter() - msg[0])
    reader.close()
    mpq_lat = []
    while (msg := mpq.get(timeout=60)) is not None:
        mpq_lat.append(time.perf_counter() - msg[0])
    results.put((rank, shm_lat, mpq_lat))


def benchmark(n_messages: int = 2000, n_readers: int = 2, payload_bytes: int = 256,
              gap_s: float = 200e-6) -> dict[str, Any]:
    """Broadcast latency (writer's put to the slowest reader's get) of this ring versus one
    `multiprocessing.Queue` per reader, measured in the same run with the same reader processes.

    Messages are spaced by `gap_s` so the figure is latency, not queueing under saturation.
    time.perf_counter is CLOCK_MONOTONIC on Linux, comparable across processes.
    """
    ctx = mp.get_context("spawn")
    ring = ShmBroadcastQueue(n_readers, n_slots=16, slot_bytes=max(4096, 2 * payload_bytes))
    queues = [ctx.Queue() for _ in range(n_readers)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_bench_reader, args=(r, ring.handle, queues[r], results), daemon=True)
             for r in range(n_readers)]
    for p in procs:
        p.start()
    writer = ShmWriter(ring.handle)
    pad = b"x" * payload_bytes
    try:
        time.sleep(0.5)  # let the readers import and attach before the clock matters
        for _ in range(n_messages):
            writer.put((time.perf_counter(), pad), timeout=60)
            time.sleep(gap_s)
        writer.put(None, timeout=60)
        for _ in range(n_messages):
            msg = (time.perf_counter(), pad)
            for q in queues:
                q.put(msg)
            time.sleep(gap_s)
        for q in queues:
            q.put(None)
        per_rank = [results.get(timeout=120) for _ in procs]
    finally:
        writer.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        ring.close()
    shm = [max(r[1][i] for r in per_rank) for i in range(n_messages)]
    mpq = [max(r[2][i] for r in per_rank) for i in range(n_messages)]
    return {"n_messages": n_messages, "n_readers": n_readers, "payload_bytes": payload_bytes,
            "gap_us": gap_s * 1e6, "shm_queue": _summary(shm), "mp_queue": _summary(mpq),
            "median_ratio_mp_over_shm": statistics.median(mpq) / statistics.median(shm)}


def _summary(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    return {"median_us": round(statistics.median(s) * 1e6, 1),
            "p99_us": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1e6, 1)}


if __name__ == "__main__":
    print(json.dumps(benchmark(), indent=2))  # noqa: T201 - the module's command-line output
