"""Whether other work held the cores while a probe timed its kernels.

A probe's timings decide a machine's kernels for good (they are cached), and timings taken while other
processes compete for the cores are meaningless: a parallel region waits for whichever thread lost its
core. The load average alone does not tell: it is a one-minute mean, so it misses work that started
just before the probe. A test suite started beside a first `forerun serve` once left SmolLM2 Q4_1's
GEMV timed at 0.96x the batched matmul (8x when calm) and its lane matmul at 20 GFLOPS (80), both
marked calm, and one request then decoded at 43 instead of 85 tok/s until the cache was deleted (AMD
EPYC, AVX2 only, 2 cores). So a watch also counts the CPU time the whole machine spent during the
probe beyond this process's own (Linux's /proc/stat; elsewhere the load average alone).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Cores' worth of other processes' CPU time during a probe above which its timings are not trusted.
OTHERS_CORES = 0.25
# ... and seconds of it at least: both counters tick in hundredths of a second (one tick a CPU), so
# over a short probe a few ticks of rounding alone would look like a quarter of a core.
OTHERS_MIN_SECONDS = 0.1
PROC_STAT = Path("/proc/stat")


def machine_busy() -> bool:
    """Whether other work holds the cores now (load average above the core count)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def _machine_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent off idle since boot (steal included: a hypervisor's
    other guests take cores too), or None where /proc/stat cannot be read."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError, IndexError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class BusyWatch:
    """Started before a probe's timings, asked after them: `busy()` when the load average was above
    the core count at either end, or other processes used more than OTHERS_CORES cores (and more
    than OTHERS_MIN_SECONDS) meanwhile."""

    def __init__(self) -> None:
        self._busy_at_start = machine_busy()
        self._start = (time.monotonic(), _machine_cpu_seconds(), _own_cpu_seconds())

    def others_seconds(self) -> float:
        """CPU seconds spent by other processes since the start (0.0 where unknown)."""
        _, machine0, own0 = self._start
        machine = _machine_cpu_seconds()
        if machine0 is None or machine is None:
            return 0.0
        return max(0.0, (machine - machine0) - (_own_cpu_seconds() - own0))

    def others_cores(self, others_seconds: float | None = None) -> float:
        """Cores' worth of CPU time spent by other processes since the start (0.0 where unknown)."""
        seconds = self.others_seconds() if others_seconds is None else others_seconds
        return seconds / max(time.monotonic() - self._start[0], 1e-3)

    def busy(self) -> bool:
        if self._busy_at_start or machine_busy():
            return True
        seconds = self.others_seconds()  # read once: both tests judge the same interval
        return seconds > OTHERS_MIN_SECONDS and self.others_cores(seconds) > OTHERS_CORES
