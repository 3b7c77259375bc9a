"""The package map holds: imports point one way down the layer table, no module import circles, core
never imports torch, small files, and no machine paths in tracked files.

Imports are read with `ast` at every level (inside functions and `if TYPE_CHECKING:` blocks too): a
deferred import is still a dependency, only a later one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "forerun"
MAX_LINES = 460

# Higher layers may import lower ones, never the reverse; a module imports freely inside its own
# layer only when both share one package (e.g. forerun.model.llama -> forerun.model.layers). A module
# belongs to the longest prefix listed. This follows the design map (entrypoints -> engine -> core /
# executor -> worker -> model -> loader / kernels) with what the code showed:
# - `core` sits below `worker`: the worker reads core's SchedulerOutput / ModelRunnerOutput (the data
#   that crosses processes each step), while core itself imports no torch, worker or model;
# - `config` validates scheduling policies that core owns, so it sits just above core;
# - the command line (`entrypoints.cli`) runs the benchmarks, which start engines from the same
#   engine flags the server takes (`entrypoints.engine_args`);
# - `loader` keeps a GGUF file's blocks as the kernels' CompactWeight, so it sits above `kernels`;
# - request/outputs/sampling_params are the user-facing data, structured.spec names a grammar in
#   SamplingParams, and platform/byte_alphabet/heap are leaf helpers.
LAYERS: list[tuple[str, ...]] = [  # top first
    ("forerun", "forerun.entrypoints.cli"),  # the package front door re-exports LLM
    ("forerun.bench",),
    ("forerun.entrypoints",),
    ("forerun.engine",),
    ("forerun.executor",),
    ("forerun.worker",),
    ("forerun.config",),
    ("forerun.core",),
    ("forerun.model",),
    ("forerun.loader",),
    ("forerun.kernels",),
    ("forerun.request", "forerun.outputs"),
    ("forerun.sampling_params",),
    ("forerun.structured",),
    ("forerun.platform", "forerun.byte_alphabet", "forerun.heap"),
]
RANK = {prefix: len(LAYERS) - i for i, names in enumerate(LAYERS) for prefix in names}
# Packages that must not see each other although the table alone would allow it.
FORBIDDEN = {
    "forerun.model": ("forerun.core", "forerun.config"),  # the model never imports the scheduler
    "forerun.kernels": ("forerun.core", "forerun.config", "forerun.loader"),
    "forerun.loader": ("forerun.core", "forerun.config"),
}
# Tracked files that may name a machine path, and why.
PATH_ALLOWED: set[str] = set()
# Spelled in pieces so that this file itself names no machine path.
MACHINE_PATHS = tuple("/" + name + "/" for name in ("work", "root", "home", "tmp"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The forerun modules `name` imports, most specific first: `from a.b import c` names a.b.c when
    that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        found.update(t for t in targets if t == "forerun" or t.startswith("forerun."))
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    # "forerun" names the package's front door only, not everything under it.
    best = max((p for p in RANK if module == p or (p != "forerun" and module.startswith(p + "."))),
               key=len, default=None)
    assert best is not None, f"{module} is in no layer of LAYERS: add it to the table"
    return best


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_module_has_a_layer_and_the_graph_is_read():
    for module in MODULES:
        _layer(module)
    # A control: the reader must see a deferred (function-level) import and a TYPE_CHECKING-free one.
    assert "forerun.loader.gguf_convert" in GRAPH["forerun.loader.model_source"], "function-level import"
    assert "forerun.kernels.gemm" in GRAPH["forerun.kernels.linear"]


def test_imports_follow_the_layer_order():
    wrong = []
    for module, targets in GRAPH.items():
        src = _layer(module)
        for target in targets:
            dst = _layer(target)
            same_package = _package(module) == _package(target)
            if RANK[dst] > RANK[src] or (RANK[dst] == RANK[src] and dst != src and not same_package):
                wrong.append(f"{module} ({src}) imports {target} ({dst})")
            for banned in FORBIDDEN.get(_package(module), ()):
                if target == banned or target.startswith(banned + "."):
                    wrong.append(f"{module} must not import {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    # Iterative depth-first search: a back edge to a module on the current path closes a circle.
    state: dict[str, int] = {}  # 1 on the path, 2 done
    circles = []
    for start in sorted(GRAPH):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(GRAPH[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif nxt not in GRAPH:
                continue  # a name inside a module (`from forerun.x import y` where y is a class)
            elif state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(GRAPH[nxt])))
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_core_never_imports_torch():
    offenders = []
    for module, path in MODULES.items():
        if not module.startswith("forerun.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{module}: {n}" for n in names if n == "torch" or n.startswith("torch.")]
    assert not offenders, offenders


def test_server_front_end_imports_no_torch():
    # The server's front end (HTTP, tokenizer, detokenizer) runs in its own process beside the engine's;
    # importing torch there would cost about 120 MB of resident memory and a second of start for nothing.
    code = "import sys, forerun.entrypoints.serve; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False", "the front end imports torch"


def test_kernels_know_no_architecture():
    # Kernels are handed weights and shapes: no model class, and no walking of a model's modules.
    for module, path in MODULES.items():
        if _package(module) == "forerun.kernels":
            code = path.read_text()
            for word in ("ForCausalLM", ".self_attn", ".mlp", "nn.Module"):
                assert word not in code, f"{module} names {word!r}"


@pytest.mark.parametrize("path", sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_files_are_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}): split it by job"


def test_no_machine_paths_in_tracked_files():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "pyproject.toml" in files, "git ls-files must list the tree"
    hits = []
    for name in files:
        if name in PATH_ALLOWED:
            continue
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or moved in the work tree and not yet committed
        for lineno, line in enumerate(text.splitlines(), 1):
            if any(p in line for p in MACHINE_PATHS):
                hits.append(f"{name}:{lineno}: {line.strip()[:100]}")
    assert not hits, "machine paths in tracked files:\n" + "\n".join(hits)
