"""Builds forerun's C kernels (`csrc/*.c`) at first use with the system compiler; loads them via ctypes.

The kernels need no torch headers (plain C, `-O3 -march=native -fopenmp`); each source compiles in
its own compiler process, as many at once as there are cores, then one link makes the library (about
17 s on 2 cores, once per machine). The library is cached by sources, flags and CPU. When no compiler
is found, the build fails or its cache folder cannot be written, `load_native_library` logs one
warning and returns None, and the model keeps its stock-PyTorch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from forerun.platform import cpu_signature

logger = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).with_name("csrc")  # shipped as package data (pyproject.toml)
SOURCES = sorted(NATIVE_DIR.glob("*.c"))
HEADERS = sorted(NATIVE_DIR.glob("*.h"))  # not compiled on their own, but part of the cache key
# gnu11, not c11: strict ISO mode turns off FMA contraction, which halves the kernels' speed.
# -fno-math-errno lets `omp simd` vectorise expf; no -ffast-math, so the arithmetic stays IEEE.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-std=gnu11"]
LINK_FLAGS = ["-shared", "-fopenmp"]
_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# name -> (restype, argtypes), for both the _f32 and _bf16 variant of each kernel.
SIGNATURES = {
    "decode_attention": (_INT, [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                                _I64, _F32, _INT, _I64, _INT]),
    "add_rms_norm": (None, [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    "silu_mul": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    "argmax_rows": (None, [_PTR, _I64, _I64, _PTR, _INT]),
    "rotary": (None, [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT]),
    "gemv_ordered": (_INT, [_PTR, _PTR, _I64, _INT, _PTR, _I64, _I64, _I64, _INT, _INT]),
    "decode_layers": (_INT, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _INT]),  # the KV cache's dtype
}
# Kernels with an fp32 variant only.
SIGNATURES_F32 = {
    "gemv_compact": (None, [_PTR, _PTR, _I64, _INT, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "gemv_pack": (None, [_PTR, _INT, _I64, _I64, _PTR]),
    "pack_weight": (None, [_PTR, _I64, _I64, _PTR, _INT]),
    "gemm_packed": (None, [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT]),
    "gemv_kquant": (_INT, [_PTR, _PTR, _I64, _INT, _PTR, _I64, _I64, _I64, _INT, _INT]),
    "gemv_kquant_isas": (_INT, []),
    "gemv_int": (_INT, [_PTR, _PTR, _I64, _INT, _INT, _PTR, _I64, _I64, _I64, _INT, _INT]),
    "gemv_int_isas": (_INT, []),
    "dequant_rows": (_INT, [_PTR, _I64, _INT, _I64, _I64, _PTR, _INT]),
    "decode_step": (_INT, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT]),
    "gemm_blocks": (_INT, [_PTR, _INT, _PTR, _I64, _INT, _PTR, _I64, _I64, _I64, _INT, _INT]),
    "gemm_blocks_isas": (_INT, [_INT]),
    "gemm_lanes": (_INT, [_PTR, _PTR, _I64, _INT, _PTR, _I64, _I64, _I64, _I64, _INT, _INT]),
    "gemm_lanes_isas": (_INT, []),
    "gemv_ordered_isas": (_INT, []),
}


def build_name(lib: ctypes.CDLL) -> str:
    """The library's file name: it carries the digest of its sources and flags, so timings of its
    kernels cached under it are taken again when a kernel changes."""
    return Path(getattr(lib, "_name", "") or "").name


def profiled(name: str) -> AbstractContextManager:
    """A label for one C kernel call in torch's profiler, which does not see ctypes calls; a no-op
    (a flag read) when no profiler runs on this thread."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def compiler_command() -> list[str] | None:
    """The C compiler as an argument list: $CC split as a shell would (it may carry a wrapper or flags,
    e.g. "ccache gcc"), else cc or gcc from PATH; None when its program is not installed."""
    configured = os.environ.get("CC", "").strip()
    try:
        argv = shlex.split(configured) if configured else []
    except ValueError:  # unbalanced quotes: no program can be named
        logger.warning("CC=%r cannot be parsed: the model uses stock PyTorch ops only", configured)
        return None
    if not argv:
        found = shutil.which("cc") or shutil.which("gcc")
        if found is None:
            logger.warning("no C compiler found (cc, gcc or $CC): the model uses stock PyTorch ops only")
            return None
        return [found]
    if shutil.which(argv[0]) is None:
        logger.warning("the C compiler %r (CC=%r) is not installed: the model uses stock PyTorch ops only",
                       argv[0], configured)
        return None
    return argv


def load_native_library(cache_root: Path) -> ctypes.CDLL | None:
    """The compiled kernel library (built into `cache_root` when absent), or None when it cannot be
    built or loaded; each reason is logged as one warning, and the model then keeps its stock ops."""
    compiler = compiler_command()
    if compiler is None:
        return None
    digest = hashlib.sha1(" ".join([*compiler, *CFLAGS, *LINK_FLAGS, cpu_signature()]).encode())
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    lib_path = cache_root / f"forerun-kernels-{digest.hexdigest()[:16]}.so"
    if not lib_path.is_file() and not _build(compiler, lib_path):
        return None
    try:
        lib = ctypes.CDLL(str(lib_path))
        exported = [(name + suffix, sig) for name, sig in SIGNATURES.items() for suffix in ("_f32", "_bf16")]
        exported += [(name + "_f32", sig) for name, sig in SIGNATURES_F32.items()]
        for symbol, (restype, argtypes) in exported:
            fn = getattr(lib, symbol)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError) as exc:  # AttributeError: a library that lacks a kernel
        logger.warning("loading %s failed (%s): using stock PyTorch ops", lib_path, exc)
        return None
    return lib


def _build(compiler: list[str], lib_path: Path) -> bool:
    """Compile the sources into `lib_path`; False (after one warning) when that cannot be done: the
    cache folder cannot be made or written, the compiler cannot be started, or the build fails."""
    tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
    try:
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as objects:
            failed = _compile_and_link(compiler, Path(objects), tmp)
        if failed is not None:
            logger.warning("building the C kernels failed, using stock PyTorch ops:\n%s", failed.stderr[-2000:])
            tmp.unlink(missing_ok=True)
            return False
        tmp.replace(lib_path)  # atomic: a concurrent start never loads half a file
    except OSError as exc:
        logger.warning("cannot build the C kernels into %s (%s): using stock PyTorch ops", lib_path.parent, exc)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the folder itself is unusable: there is nothing to clean up
        return False
    return True


def _compile_and_link(compiler: list[str], objects: Path, out: Path) -> subprocess.CompletedProcess | None:
    """Each source into an object in `objects`, all at once on as many threads as cores (the sources
    differ tenfold in compile time; the threads only wait on compiler processes), then the objects into
    the library `out`. Returns the first failed compiler run, or None."""
    commands = [[*compiler, *CFLAGS, "-c", str(src), "-o", str(objects / f"{src.stem}.o")] for src in SOURCES]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        failed = next((run for run in pool.map(_run, commands) if run.returncode != 0), None)
    if failed is not None:
        return failed
    link = _run([*compiler, *LINK_FLAGS, "-o", str(out), *(argv[-1] for argv in commands), "-lm"])
    return link if link.returncode != 0 else None


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True)
