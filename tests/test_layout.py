"""The package's structure, read from its source (nothing is imported): no import cycles, and
the helpers that several backends use come from flashcore.reference, not from a peer backend.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashcore"

#: Cycles known and left on purpose, with the reason. (A cycle that goes away is no failure;
#: strike it from here then.)
KNOWN_CYCLES: set = set()


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods, deferred: bool) -> set[str]:
    """The flashcore modules ``name`` imports: at module level, or anywhere (``deferred``:
    imports inside functions too). Importing a.b.c runs the subpackage a.b's __init__ too, so
    it counts (the top package's, the public facade that imports everything, does not)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = ast.walk(tree) if deferred else iter(_module_level(tree.body))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] \
                if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for full in names:
            parts = full.split(".")
            for i in range(2, len(parts) + 1):
                m = ".".join(parts[:i])
                if m in mods and m != name and not name.startswith(m + "."):
                    found.add(m)
    return found


def _module_level(body):
    """Statements run when the module is imported: the body, and inside if/try/with blocks."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                break
            if isinstance(inner, list):
                yield from _module_level(inner)


def _cycles(graph: dict[str, set[str]]) -> set[frozenset]:
    """The module sets of the graph's cycles (strongly connected components of more than one
    module)."""
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _graph(deferred: bool) -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods, deferred) for m, p in mods.items()}


def test_the_graph_sees_imports():
    """The reader works: it finds imports known to exist, relative, deferred and of a package."""
    top, every = _graph(False), _graph(True)
    assert "flashcore.spec" in top["flashcore.api"]
    assert "flashcore.backends" in top["flashcore.api"]            # via flashcore.backends.base
    assert "flashcore.backends.torch_ops" in top["flashcore.api"]     # bound once, no torch
    assert "flashcore.jit" not in top["flashcore.kernels.forward"]
    assert "flashcore.jit" in every["flashcore.kernels.forward"]   # at call time
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}


def test_no_import_cycle_at_module_level():
    assert _cycles(_graph(False)) == set()


def test_no_import_cycle_through_deferred_imports_but_the_known():
    """Deferred (function-level) imports too: a cycle through them is a layering knot even when
    Python tolerates it. (jit -> kernels/plans -> kernels/params -> jit was one.)"""
    unexpected = _cycles(_graph(True)) - KNOWN_CYCLES
    assert not unexpected, [sorted(c) for c in unexpected]


def test_jit_sits_at_the_bottom():
    """The kernel loader takes only leaves (the settings and the device layer, which import
    nothing of flashcore): the cycle jit -> plans -> params -> jit is gone."""
    every = _graph(True)
    assert every["flashcore.jit"] <= {"flashcore.config", "flashcore.kernels",
                                      "flashcore.kernels.device"}
    assert every["flashcore.kernels"] == set()
    assert every["flashcore.kernels.device"] == set()
    assert every["flashcore.config"] == set()


def test_backends_take_shared_helpers_from_the_reference_not_from_a_peer():
    every = _graph(True)
    peers = {"flashcore.backends.numpy_backend", "flashcore.backends.cupy_backend"}
    for mod, deps in every.items():
        if mod in ("flashcore", "flashcore.backends"):   # the facade re-exports an error
            continue                                      # class; the registry registers
        assert not (deps & peers) - {mod}, (mod, sorted(deps & peers))
    # the oracle depends on no backend and on nothing that calls one
    assert not any(d.startswith("flashcore.backends") or d == "flashcore.api"
                   for d in every["flashcore.reference"])
    # and no backend calls back into the public API
    for mod, deps in every.items():
        if mod.startswith("flashcore.backends"):
            assert "flashcore.api" not in deps, mod
