"""Start and stop a real `forerun serve` subprocess for the server tests, and read its /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """All live descendants of `pid` (read from /proc, no psutil needed)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = {int(c) for c in children.read_text().split()}
            except OSError:
                continue
            todo.extend(kids - out)
            out |= kids
    return out


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (the API process, the core and its workers)."""
    total = 0
    for p in {pid} | descendants(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass  # exited meanwhile
    return total


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    api_key: str | None
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{", 1)[0]] = values.get(name.split("{", 1)[0], 0.0) + float(value)
        return values


def wait_idle(server: Server, timeout_s: float = 15) -> dict[str, float]:
    """Metrics once nothing runs or waits and no block is held (or the last reading at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if (m["forerun:num_requests_running"] == 0 and m["forerun:num_requests_waiting"] == 0
                and m["forerun:kv_cache_blocks_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def start_server(model: str | Path | None, *args: str, api_key: str | None = None, timeout_s: float = 180,
                 env: dict[str, str] | None = None, api_key_file: Path | None = None,
                 through_cli: bool = False) -> Server:
    """`api_key` is passed as --api-key, `api_key_file` as --api-key-file (its content becomes
    `Server.api_key`); a key given only through `env` (FORERUN_API_KEY) is the caller's to send, so set
    `Server.api_key` afterwards. `through_cli` starts it as `forerun serve` does (the whole command line)."""
    port = free_port()
    entry = ["forerun.entrypoints.cli", "serve"] if through_cli else ["forerun.entrypoints.serve"]
    cmd = [sys.executable, "-m", *entry] + ([str(model)] if model else []) + [
        "--port", str(port), "--uvicorn-log-level", "warning", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    if api_key_file is not None:
        cmd += ["--api-key-file", str(api_key_file)]
        api_key = api_key_file.read_text().strip()
    log_path = Path(tempfile.mkstemp(prefix="forerun-serve-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", api_key, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(server)
    raise RuntimeError(f"server did not start within {timeout_s} s:\n{server.log()}")


def serving(model: str | Path | None, *args: str, api_key: str | None = None,
            api_key_file: Path | None = None) -> Iterator[Server]:
    """A module fixture's body: the server while the module's tests run, then stopped (unless a test
    stopped it already) with no process left behind."""
    srv = start_server(model, *args, api_key=api_key, api_key_file=api_key_file)
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            _, left = stop_server(srv)
            assert not left


def stop_server(server: Server, sig: int = signal.SIGTERM, timeout_s: float = 30) -> tuple[int, set[int]]:
    """Signal the server, wait for it, and return its exit code and any descendants still alive."""
    kids = descendants(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(sig)
    try:
        code = server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = server.proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(k) for k in kids):
        time.sleep(0.1)
    left = {k for k in kids if alive(k)}
    for k in left:  # never leave processes behind, even when the test fails
        os.kill(k, signal.SIGKILL)
    server.log_path.unlink(missing_ok=True)
    return code, left
