"""The step timeline: Chrome trace JSON (opens in Perfetto) and a sync-vs-async PNG."""

from __future__ import annotations

import json
from pathlib import Path

from forerun.engine.step_trace import StepTrace

_COLORS = {"schedule": "tab:blue", "prepare": "tab:cyan", "recv": "tab:purple", "forward": "tab:green",
           "sample": "tab:olive",
           "update": "tab:orange", "output": "tab:red", "wait": "lightgray"}


def chrome_trace(traces: dict[str, StepTrace]) -> dict:
    """One process per mode, one track per thread; dead tokens appear as instant events."""
    events = []
    for pid, (mode, trace) in enumerate(traces.items(), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": mode}})
        tids: dict[str, int] = {}
        for e in trace.events:
            tid = tids.setdefault(e.thread, len(tids) + 1)
            ts = (e.begin - trace.origin) * 1e6
            events.append({"ph": "X", "name": e.name, "pid": pid, "tid": tid, "ts": ts,
                           "dur": max((e.end - e.begin) * 1e6, 0.01), "args": {"step": e.step, **e.args}})
            for rid in e.args.get("dead_tokens", ()):
                events.append({"ph": "i", "s": "t", "name": "dead token", "pid": pid, "tid": tid, "ts": ts,
                               "args": {"request": rid, "step": e.step}})
        for thread, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(traces: dict[str, StepTrace], path: Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(traces)))


def plot_timelines(traces: dict[str, StepTrace], path: Path, max_steps: int = 12) -> None:
    """Draw each mode's first `max_steps` decode-phase steps one above the other, on a shared time scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(13, 2.4 * len(traces)), squeeze=False)
    width = 0.0
    for ax, (mode, trace) in zip(axes[:, 0], traces.items()):
        events = _window(trace, max_steps)
        if not events:
            continue
        t0 = min(e.begin for e in events)
        threads = sorted({e.thread for e in events}, key=lambda t: (t != "MainThread", t))
        for e in events:
            y = threads.index(e.thread)
            ax.barh(y, (e.end - e.begin) * 1e3, left=(e.begin - t0) * 1e3, height=0.6,
                    color=_COLORS.get(e.name, "gray"), edgecolor="black", linewidth=0.3)
            if e.args.get("dead_tokens"):
                ax.plot((e.begin - t0) * 1e3, y + 0.38, marker="v", color="red")
        width = max(width, max(e.end for e in events) - t0)
        ax.set_yticks(range(len(threads)), threads)
        ax.set_title(f"{mode}: busy fraction {trace.busy_fraction():.2f}", loc="left", fontsize=10)
    for ax in axes[:, 0]:
        ax.set_xlim(0, width * 1e3)
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, list(_COLORS), loc="upper right", ncol=len(_COLORS), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _window(trace: StepTrace, max_steps: int):
    """Steps from the middle of the run, where decode is steady."""
    steps = sorted({e.step for e in trace.events})
    if not steps:
        return []
    mid = steps[len(steps) // 2]
    keep = set(range(mid, mid + max_steps))
    return [e for e in trace.events if e.step in keep]
