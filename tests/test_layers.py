"""The package's layers, checked over its own imports (docs/architecture.md draws them).

Each module belongs to one layer and imports only modules of its own layer or below;
no module imports a tapegrad module inside a function (optional third-party packages —
highspy, matplotlib, IPython — may be imported lazily); the import graph has no cycle;
no module passes 600 lines; and every module imports alone in a fresh interpreter.
Higher layers reach lower ones' behaviour through registries the lower layer owns
(`tapegrad.core.tape.register_kind`, `register_printer`,
`tapegrad.core.residual_policy.register_auto_prefetch`,
`tapegrad.engine.interpret.register_segment_call`, `tapegrad.core.caches.register`), never
by importing upward.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tapegrad")
MAX_LINES = 600

# Bottom up: the package's folders are its layers. A module takes the first layer with a
# matching pattern.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("_version", "errors", "core", "core.*")),
    ("rules", ("rules", "rules.*")),
    ("anomaly", ("anomaly", "anomaly.*")),
    ("engine", ("engine", "engine.*")),
    ("passes", ("passes", "passes.*")),
    ("api", ("api", "api.*")),
    ("display", ("display", "display.*")),
    # The concrete policies; the package's own __init__ (which also re-exports the
    # planner's `budget`) and the documented `tapegrad.policies.budget` path sit above the
    # planner, in "facade".
    ("policies", ("policies.?*",)),
    ("planner", ("planner", "planner.*")),
    ("facade", ()),
    ("report", ("report", "report.*")),
    ("package", ("", "__main__")),
]
# Checked before the general patterns above (a module named by two patterns).
_EXACT_FIRST = {"policies": "facade", "policies.budget": "facade"}


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                name = rel[: -len("__init__")].rstrip(".") if rel.endswith("__init__") else rel
                out[name] = path
    return out


def layer_of(name: str) -> int | None:
    if name in _EXACT_FIRST:
        return [n for n, _ in LAYERS].index(_EXACT_FIRST[name])
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    return None


def _targets(node: ast.AST, pkg: str, mods: dict[str, str]) -> list[str]:
    """The tapegrad modules (names relative to the package) an import statement binds."""
    found = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            parts = pkg.split(".") if pkg else []
            base = parts[: len(parts) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        elif node.module == "tapegrad" or (node.module or "").startswith("tapegrad."):
            mod = node.module[len("tapegrad.") :] if node.module != "tapegrad" else ""
        else:
            return []
        for a in node.names:
            sub = f"{mod}.{a.name}" if mod else a.name
            found.append(sub if sub in mods else mod)
    elif isinstance(node, ast.Import):
        for a in node.names:
            if a.name == "tapegrad" or a.name.startswith("tapegrad."):
                found.append(a.name[len("tapegrad.") :] if a.name != "tapegrad" else "")
    return [t for t in found if t in mods]


def _graph():
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    lazy: list[str] = []
    for name, path in mods.items():
        pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        tree = ast.parse(open(path).read())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            targets = [t for t in _targets(node, pkg, mods) if t != name]
            if not targets:
                continue
            if id(node) not in top:
                lazy.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            edges[name].update(targets)
    return mods, edges, lazy


MODS, EDGES, LAZY = _graph()


def test_every_module_has_a_layer():
    assert not [m for m in MODS if layer_of(m) is None]


def test_no_function_level_imports_of_tapegrad():
    assert not LAZY, "\n".join(LAZY)


def test_imports_go_down_the_layers():
    names = [n for n, _ in LAYERS]
    up = [
        f"{m} ({names[layer_of(m)]}) imports {t} ({names[layer_of(t)]})"
        for m, ts in EDGES.items()
        for t in ts
        if layer_of(t) > layer_of(m)
    ]
    assert not up, "\n".join(sorted(up))


def test_no_import_cycles():
    # Tarjan's strongly connected components; a package importing its own submodule
    # (and the submodule importing a sibling through the package) is Python's, not a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in MODS:
        if m not in index:
            visit(m)
    real = [c for c in cycles if not (len(c) == 2 and (c[0] == "" or c[1].startswith(c[0] + ".")))]
    assert not real, real


def test_no_module_over_600_lines():
    long = {m: n for m, p in MODS.items() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not long, long


def _import_alone(name: str) -> tuple[str, str]:
    mod = f"tapegrad.{name}" if name else "tapegrad"
    r = subprocess.run(
        [sys.executable, "-c", f"import {mod}"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return mod, r.stderr.strip().splitlines()[-1] if r.returncode else ""


@pytest.mark.slow
def test_every_module_imports_alone():
    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [(m, err) for m, err in pool.map(_import_alone, sorted(MODS)) if err]
    assert not failed, failed
