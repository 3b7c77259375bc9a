"""The probes' judge of a busy machine counts other processes' CPU time, not only the load average."""

from __future__ import annotations

import subprocess
import sys
import time

from forerun.kernels import busy_watch
from forerun.kernels.busy_watch import OTHERS_CORES, BusyWatch

BURN = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass\n"


def test_other_processes_spinning_make_a_probe_busy_though_the_load_average_is_calm(monkeypatch) -> None:
    monkeypatch.setattr(busy_watch, "machine_busy", lambda: False)  # the one-minute mean has not risen yet
    watch = BusyWatch()
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(2)]
    try:
        for p in burners:
            p.wait(timeout=30)
    finally:
        for p in burners:
            p.kill()
    assert watch.others_cores() > OTHERS_CORES and watch.busy()


def test_the_probes_own_work_is_not_counted_against_it(monkeypatch) -> None:
    monkeypatch.setattr(busy_watch, "machine_busy", lambda: False)
    watch = BusyWatch()
    end = time.monotonic() + 0.4
    while time.monotonic() < end:  # this process keeps a core busy, as a probe's timings do
        pass
    assert watch.others_cores() < 0.75


def test_without_proc_stat_the_load_average_decides(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(busy_watch, "PROC_STAT", tmp_path / "absent")
    monkeypatch.setattr(busy_watch, "machine_busy", lambda: False)
    assert BusyWatch().others_cores() == 0.0 and not BusyWatch().busy()
    monkeypatch.setattr(busy_watch, "machine_busy", lambda: True)
    assert BusyWatch().busy()
