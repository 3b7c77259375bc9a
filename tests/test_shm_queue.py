"""The shared-memory broadcast ring: order, back-pressure, payloads far beyond a slot, cleanup, benchmark."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import subprocess
import sys
import threading

import pytest

from forerun.executor.shm_queue import (EMPTY, QueueTimeout, ShmBroadcastQueue, ShmReader, ShmWriter,
                                        benchmark)


def _echo_child(handle, reader_index: int, results) -> None:
    """Read until None; report each message's kind and a digest so the parent can check content."""
    reader = ShmReader(handle, reader_index)
    seen = []
    while (msg := reader.get(timeout=60)) is not None:
        seen.append((msg[0], hashlib.sha256(msg[1]).hexdigest()))
    reader.close()
    results.put((reader_index, seen))


def test_two_processes_receive_everything_in_order_including_10mb():
    ctx = mp.get_context("spawn")
    ring = ShmBroadcastQueue(n_readers=2, n_slots=4, slot_bytes=4096)
    results = ctx.Queue()
    procs = [ctx.Process(target=_echo_child, args=(ring.handle, r, results)) for r in range(2)]
    for p in procs:
        p.start()
    big = os.urandom(10 * 1024 * 1024)
    msgs = [(i, os.urandom(i * 37 % 3000)) for i in range(50)] + [(50, big)] + [(51 + i, b"x" * i) for i in range(20)]
    writer = ShmWriter(ring.handle)
    try:
        for m in msgs:
            writer.put(m, timeout=60)  # 4 slots for 71 messages: exercises waiting for slow readers
        writer.put(None, timeout=60)
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
        writer.close()
        ring.close()
    expected = [(i, hashlib.sha256(b).hexdigest()) for i, b in msgs]
    assert got[0] == expected and got[1] == expected
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(ring.handle.name)]  # no side segment left


def test_threads_order_and_backpressure():
    ring = ShmBroadcastQueue(n_readers=2, n_slots=2, slot_bytes=128)
    writer = ShmWriter(ring.handle)
    readers = [ShmReader(ring.handle, r) for r in range(2)]
    assert readers[0].try_get() is EMPTY
    writer.put("a")
    writer.put("b")
    with pytest.raises(QueueTimeout):  # both slots unread: the writer must wait, never overwrite
        writer.put("c", timeout=0.05)
    assert readers[0].get(timeout=1) == "a"
    with pytest.raises(QueueTimeout):  # reader 1 has not read slot 0 yet
        writer.put("c", timeout=0.05)
    assert readers[1].get(timeout=1) == "a"
    writer.put("c", timeout=1)
    out: dict[int, list] = {0: [], 1: []}

    def drain(r: int) -> None:
        while (m := readers[r].get(timeout=5)) != "end":
            out[r].append(m)

    threads = [threading.Thread(target=drain, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for i in range(500):
        writer.put(i, timeout=5)
    writer.put("end", timeout=5)
    for t in threads:
        t.join()
    assert out[0] == out[1] == ["b", "c"] + list(range(500))
    for x in (*readers, writer):
        x.close()
    ring.close()
    assert not os.path.exists(f"/dev/shm/{ring.handle.name}")


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="n_readers"):
        ShmBroadcastQueue(n_readers=0)
    ring = ShmBroadcastQueue(n_readers=1, n_slots=1, slot_bytes=64)
    try:
        with pytest.raises(ValueError, match="reader"):
            ShmReader(ring.handle, 1)
    finally:
        ring.close()


def test_benchmark_reports_both_queues():
    res = benchmark(n_messages=300, n_readers=2)
    for key in ("shm_queue", "mp_queue"):
        assert 0 < res[key]["median_us"] <= res[key]["p99_us"]
    assert res["median_ratio_mp_over_shm"] > 0


CUT_SHORT = """
from forerun.executor.shm_queue import ShmBroadcastQueue

ring = ShmBroadcastQueue(1)
ring._shm.unlink()  # as far as a close gets before a signal stops it (the segment removed)
ring.close()  # the close that finishes the job
ring.close()
print("closed", ring.handle.name)
"""


def test_a_close_cut_short_by_a_signal_is_finished_by_the_next():
    # A fresh interpreter: the resource tracker reports leaked segments when that process exits.
    run = subprocess.run([sys.executable, "-c", CUT_SHORT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("closed ")
    assert "leaked" not in run.stderr and "Warning" not in run.stderr, run.stderr
