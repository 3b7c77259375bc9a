"""GGUF blocks live once, in one memory map of transparent huge pages (forerun.kernels.huge_pages)."""

from __future__ import annotations

import re
import resource
from pathlib import Path

import gguf
import pytest
import torch
from gguf_factory import tiny_vocab, write_model_gguf
from transformers import LlamaConfig, LlamaForCausalLM

from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.huge_pages import HUGE_PAGE, HugePageArena
from forerun.loader.gguf_convert import describe_gguf
from forerun.model.registry import load_model

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arena_copies_are_equal_aligned_and_checked() -> None:
    tensors = [torch.randint(0, 256, (3, 1001), dtype=torch.uint8), torch.randn(5, 7),
               torch.randn(4 << 20 >> 2), torch.arange(10, dtype=torch.int16)[::2]]  # the last one strided
    sizes = [t.numel() * t.element_size() for t in tensors]
    arena = HugePageArena(HugePageArena.room_for(sizes))
    copies = [arena.copy(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.is_contiguous()
        assert c.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0, "the arena starts on a huge-page boundary"
    assert all(b.data_ptr() > a.data_ptr() for a, b in zip(copies, copies[1:])), "back to back, in order"
    with pytest.raises(ValueError, match="t: "):
        arena.copy(torch.zeros(1, dtype=torch.uint8))  # full
    if THP_SETTING.is_file() and "[never]" not in THP_SETTING.read_text():
        assert _huge_kib_at(copies[2].data_ptr()) >= HUGE_PAGE // 1024, "the 4 MiB copy sits on huge pages"


def _model_gguf(tmp_path: Path) -> Path:
    vocab = len(tiny_vocab()[0])
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path / "m.gguf"
    # One format for q/k/v and gate/up: each packed layer stacks its parts into one block matrix.
    write_model_gguf(path, LlamaForCausalLM(config).eval(), "llama", gguf.GGMLQuantizationType.Q4_1)
    return path


def _compact_weights(model: torch.nn.Module) -> list[CompactWeight]:
    """Every CompactWeight a module holds: as an attribute, or in a list or dict attribute."""
    found = []
    for module in model.modules():
        for value in vars(module).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            found += [v for v in items if isinstance(v, CompactWeight)]
    return found


def test_a_gguf_model_holds_each_block_matrix_once_in_one_arena(tmp_path: Path) -> None:
    path = _model_gguf(tmp_path)
    describe_gguf(path, tmp_path / "model")
    model = load_model(tmp_path / "model", torch.float32, torch.device("cpu"))
    held = {w.data.data_ptr(): w for w in _compact_weights(model)}
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
                     if t.tensor_type == gguf.GGMLQuantizationType.Q4_1)
    # Merged q/k/v and gate/up are copies of their parts: a module that kept the parts too would
    # hold more than the file's blocks (and outside the arena).
    assert sum(w.data.numel() for w in held.values()) == file_bytes
    start = min(held)
    assert start % HUGE_PAGE == 0
    assert max(p + w.data.numel() for p, w in held.items()) - start < file_bytes + 64 * len(held)


def test_the_move_hands_back_the_originals_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading peaks at the move's end unless the originals' memory goes back during it: each call of
    `release` must come with the originals copied so far already dropped."""
    import weakref

    import forerun.model.layers as layers
    import forerun.model.registry as registry

    path = _model_gguf(tmp_path)
    describe_gguf(path, tmp_path / "model")
    sources: list[weakref.ref] = []
    alive_at_release: list[int] = []
    copy = HugePageArena.copy
    monkeypatch.setattr(HugePageArena, "copy", lambda self, t: (sources.append(weakref.ref(t)), copy(self, t))[1])
    monkeypatch.setattr(layers, "RELEASE_EVERY", 1)  # after every holder
    monkeypatch.setattr(registry, "trim_heap", lambda: alive_at_release.append(sum(r() is not None for r in sources)))
    load_model(tmp_path / "model", torch.float32, torch.device("cpu"))
    assert len(alive_at_release) >= len(sources) - 1 >= 4, "released as the blocks move, not once at the end"
    # At most one original copied so far is still alive at a release: the tied embedding table, which
    # the LM head holds too until the move reaches it.
    assert max(alive_at_release) <= 1 and sum(r() is not None for r in sources) == 0


# In a fresh interpreter, so that malloc's thresholds start at glibc's defaults. A worker thread first
# frees one large block (as loading does; glibc then raises its thresholds), then frees 48 MiB of
# pieces (as the weights' first copies are freed after their move to huge pages); a 20 MiB block is
# mapped on its own under glibc's default threshold, and comes from the heap once it is fixed.
_HEAP_SCRIPT = """
import sys, threading
import numpy as np
from forerun.heap import fix_heap_thresholds, return_free_heap
def rss():
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmRSS"))) // 1024
def region(address):
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return start
def load():
    if sys.argv[1] == "fixed":
        fix_heap_thresholds()
    small = np.ones(1024, np.float32)  # the thread's arena, made at its first block
    block = np.ones(20 << 18, np.float32)
    mapped = region(block.ctypes.data) != region(small.ctypes.data)
    del block
    parts = [np.ones(1 << 18, np.float32) for _ in range(48)]
    keep = np.ones(16, np.float32)
    resident = rss()
    del parts
    return_free_heap()
    print(int(mapped), resident - rss())
def steps():  # a step's 24 MiB of temporaries, freed and taken again each step
    import resource
    fix_heap_thresholds(int(sys.argv[2]))
    keep = np.ones(1 << 18, np.float32)
    for step in range(11):
        if step == 1:
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        logits = np.ones(24 << 18, np.float32)
        del logits
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults)
thread = threading.Thread(target=steps if len(sys.argv) > 2 else load)
thread.start()
thread.join()
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads maps and resident memory from /proc")
def test_fixed_heap_thresholds_keep_blocks_in_the_heap_and_give_freed_memory_back() -> None:
    import subprocess
    import sys

    def run(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT, mode], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        mapped, returned = out.stdout.split()
        return int(mapped), int(returned)

    mapped, returned = run("fixed")
    assert not mapped  # a 20 MiB block: from the heap, no map and page faults of its own
    assert returned >= 40  # MiB of the 48 freed: a free top over the trim threshold went back
    assert run("default")[0]  # glibc's own threshold maps it (else this test would show nothing)


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="counts a thread's page faults")
def test_once_serving_a_steps_temporaries_stay_in_the_heap_between_steps() -> None:
    import subprocess
    import sys

    from forerun.heap import LOAD_TRIM, STEP_TRIM

    def faults(trim: int) -> int:
        out = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT, "fixed", str(trim)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    assert faults(STEP_TRIM) < 500  # 10 steps of 24 MiB written: taken from the kept top
    assert faults(LOAD_TRIM) > 2000  # given back at frees and faulted in again (6,144 pages a step)
