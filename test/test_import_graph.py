"""No import cycles in ``oxygen_ros``, and no arrow from a core room up into the ROS shells.

The package's own imports form a graph without cycles, and the core rooms (``CORE``: model, kv, engine, sim, train,
bags) import nothing from ``ros/`` or ``tools/`` (``SHELLS``), so each runs without the layers above it.

The graph is read from the source (``ast``), not by importing: every ``import`` / ``from ... import`` statement of
every module, at module level *and* inside functions (a lazy import that closes a cycle is a cycle too: it only
moves the failure to the first call, as ``tools/bags/replay.py`` -> ``output_bag.py`` -> ``bags.py`` did).  A statement
``from pkg import name`` points at the submodule ``pkg.name`` when that is a module, else at ``pkg`` itself (its
``__init__``); the implicit import of parent packages is not an edge (a package's ``__init__`` importing its own
submodules is how packages are built, not a cycle).  Generated messages (``oxygen_ros.msg`` ...) are not in the source
tree and are ignored.  The checkers themselves are tested on a planted lazy cycle and planted upward imports.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "oxygen_ros"
CORE = ("model", "kv", "engine", "sim", "train", "bags")      # rooms that never import the shells
SHELLS = ("ros", "tools")


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under the package directory ``root`` (``__init__`` = the package)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def import_edges(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules its import statements name (anywhere in the file)."""
    mods = module_names(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
            for t in targets:
                while t and t not in mods:          # `import a.b.c` of a non-module attribute path: its module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def room(module: str) -> str:
    """The top-level room of a dotted module name (``oxygen_ros.train.data`` -> ``train``; the package itself: "")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(edges: dict[str, set[str]], core=CORE, shells=SHELLS) -> list[tuple[str, str]]:
    """(importer, imported) for every import from a module of a ``core`` room into a ``shells`` room, sorted."""
    return sorted((m, t) for m, targets in edges.items() if room(m) in core for t in targets if room(t) in shells)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    edges = import_edges(PACKAGE)
    assert len(edges) > 40 and "oxygen_ros.bags.types" in edges["oxygen_ros.tools.bags.output"]
    found = cycles(edges)
    assert found == [], "import cycles (modules importing each other, directly or through others, lazily or not): " \
        + "; ".join(" <-> ".join(c) for c in found)


def test_the_checker_finds_a_lazy_cycle(tmp_path):
    """A planted package: a -> b at module level, b -> a inside a function (the shape of the old bags/output_bag
    cycle), plus c importing its own package's __init__, which is not a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .c import C\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x  # noqa\n")
    (pkg / "sub" / "c.py").write_text("from . import d\nfrom .. import a\nC = 1\n")
    (pkg / "sub" / "d.py").write_text("import os\n")
    edges = import_edges(pkg)
    assert edges["pkg.sub.c"] == {"pkg.sub.d", "pkg.a"} and edges["pkg.sub"] == {"pkg.sub.c"}
    assert cycles(edges) == [["pkg.a", "pkg.b"]]


def test_no_core_room_imports_ros_or_tools():
    edges = import_edges(PACKAGE)
    assert {room(m) for m in edges} >= set(CORE) | set(SHELLS), "a room is missing from the graph"
    assert "oxygen_ros.bags.types" in edges["oxygen_ros.train.data"]      # the bag type store sits below train/
    found = upward_imports(edges)
    assert found == [], "core rooms (" + ", ".join(CORE) + ") must not import ros/ or tools/: " \
        + "; ".join(f"{a} -> {b}" for a, b in found)


def test_the_checker_finds_upward_imports(tmp_path):
    """A planted package: model/ imports ros/ lazily (inside a function), train/ imports tools/ at module level with
    an absolute import, bags/ imports ros/ through ``from .. import``; tools/ -> model/ and ros/ -> kv/ are the
    allowed direction and kv/ -> model/ stays inside the core."""
    pkg = tmp_path / "pkg"
    for d in ("model", "kv", "train", "bags", "ros", "tools"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "net.py").write_text("def f():\n    from ..ros import node  # noqa\n")
    (pkg / "kv" / "pool.py").write_text("from ..model.net import f\n")
    (pkg / "train" / "data.py").write_text("import pkg.tools.cli\n")
    (pkg / "bags" / "types.py").write_text("from .. import ros\n")
    (pkg / "ros" / "node.py").write_text("from ..kv import pool\n")
    (pkg / "tools" / "cli.py").write_text("from pkg.model.net import f\n")
    assert upward_imports(import_edges(pkg)) == [("pkg.bags.types", "pkg.ros"), ("pkg.model.net", "pkg.ros.node"),
                                                 ("pkg.train.data", "pkg.tools.cli")]
