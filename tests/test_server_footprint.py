"""What `forerun serve` keeps resident beside the model: one front-end process without torch or numpy,
and the engine core as its only child (no multiprocessing resource tracker).

Why it matters: on SmolLM2 Q4_1 the whole server held 514 MB after four requests, against llama-server's
321 MB; numpy in the front end (pulled in by the benchmarks' command-line options) cost 15 MB, the
resource tracker 13 MB, and what parsing tokenizer.json and building the routes left free but resident
another 15 MB.
"""

from __future__ import annotations

import httpx
import psutil

from serve_helpers import start_server, stop_server


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_front_end_holds_no_numpy_or_torch_and_starts_one_child(tiny_llama_dir):
    srv = start_server(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "256",
                       "--num-kv-blocks", "64", through_cli=True)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200, r.text
        front = _maps(srv.proc.pid)
        assert "_multiarray_umath" not in front, "the front end imported numpy"
        assert "libtorch" not in front, "the front end imported torch"
        children = psutil.Process(srv.proc.pid).children()
        assert len(children) == 1, [" ".join(k.cmdline())[:200] for k in children]
        assert "libtorch" in _maps(children[0].pid)  # the engine core, which runs the model
    finally:
        _, left = stop_server(srv)
    assert not left, f"processes left behind: {left}"
