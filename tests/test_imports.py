"""No import cycles among kvflow's modules (issue #16).

The graph is built from the source with ``ast`` (nothing is imported): an edge ``a -> b``
for each import in ``a`` of a kvflow module ``b``. Two graphs:

- module level (``lazy=False``): statements at the top level of the module or of a class
  body, inside module-level ``if`` / ``try`` / ``with`` blocks too, but not in a function
  body. A cycle here can fail at import time (a partially initialised module);
- with lazy imports (``lazy=True``, what the test holds): imports inside function bodies
  count too. A lazy import that closes a circle only hides it (the import runs when the
  function does): the circles issue #16 names (config -> quantization -> model -> config,
  engine <-> distributed.worker, attention <-> triton_attention) were all of that kind and
  are invisible at module level. A lazy import that closes no circle (an optional
  dependency, a heavy module few paths need) is fine.

Never an edge: imports under ``if TYPE_CHECKING:`` (never run), and the implicit import of
a module's parent packages (every package's ``__init__`` would otherwise close a circle with
each module that re-exports from it). ``from pkg import name`` is an edge to ``pkg.name``
when that is a module, else to ``pkg``. Cycles: Tarjan's strongly connected components
(a depth-first search), each reported as one shortest cycle through it.

Run it as a script to print the cycles of both graphs: ``python tests/test_imports.py``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "kvflow"
ROOT = Path(__file__).resolve().parent.parent


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (``pkg/__init__.py`` is ``pkg``)."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], lazy: bool, type_only: bool = False):
    """The Import / ImportFrom statements run when the module is imported, and with ``lazy``
    also those in function bodies (at any depth); those under ``if TYPE_CHECKING:`` only
    with ``type_only``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if type_only or not _is_type_checking(node.test):
                yield from _imports(node.body, lazy, type_only)
            yield from _imports(node.orelse, lazy, type_only)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _imports(block, lazy, type_only)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _imports(node.body, lazy, type_only)
            yield from _imports(getattr(node, "orelse", []), lazy, type_only)
        elif isinstance(node, ast.ClassDef):
            yield from _imports(node.body, lazy, type_only)
        elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(node.body, lazy, type_only)


def import_graph(files: dict[str, Path] | None = None, lazy: bool = False,
                 type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level, and with ``lazy`` also in
    function bodies, with ``type_only`` also under ``if TYPE_CHECKING:`` (see the module
    docstring)."""
    files = module_files() if files is None else files
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path)).body, lazy, type_only):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            for target in targets:
                while target and target not in files:  # `import kvflow.a.b` names kvflow.a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each
    as one cycle through it (``[a, b, ..., a]``), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_cycle_through(graph, c) for c in components)


def _cycle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle from the component's first module back to it (breadth-first, shortest)."""
    members, start = set(component), component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:  # v's path back to start, reversed, then the closing edge
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {component}")


def format_cycles(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(c) for c in cycles)


# --- the checker's own tests: it must find what it is meant to find ------------------------

def _graph_of(tmp_path: Path, sources: dict[str, str], lazy: bool = False) -> dict[str, set[str]]:
    for rel, text in sources.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(module_files(tmp_path, "pkg"), lazy)


_SOURCES = {
        "__init__.py": "",
        "a.py": "from pkg.b import thing\n",
        "b.py": "import pkg.c as c\nclass K:\n    from pkg import d\n",
        "c.py": "try:\n    from . import a\nexcept ImportError:\n    pass\n",
        "d.py": "def f():\n    from pkg import e\n",
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
                "import pkg.sub.x\n",
        "sub/__init__.py": "",
        "sub/x.py": "from ..e import y\nfrom .. import d\n",
}


def test_checker_finds_module_level_cycles(tmp_path):
    graph = _graph_of(tmp_path, _SOURCES)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c", "pkg.d"}
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == set()
    assert graph["pkg.e"] == {"pkg.sub.x"} and graph["pkg.sub.x"] == {"pkg.e", "pkg.d"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.e", "pkg.sub.x", "pkg.e"]]


def test_checker_with_lazy_imports_sees_the_circle_a_function_hides(tmp_path):
    """d imports e inside a function and e's d is TYPE_CHECKING only: no circle; once e
    imports d for real, the lazy import closes one."""
    graph = _graph_of(tmp_path, _SOURCES, lazy=True)
    assert graph["pkg.d"] == {"pkg.e"} and graph["pkg.e"] == {"pkg.sub.x"}
    assert ["pkg.d", "pkg.e", "pkg.sub.x", "pkg.d"] in find_cycles(graph)  # via sub.x's `from .. import d`
    sources = {**_SOURCES, "sub/x.py": "", "e.py": "import pkg.d\n",
               "f.py": "async def g():\n    with open('x'):\n        from pkg import e\n"}
    graph = _graph_of(tmp_path / "2", sources, lazy=True)
    assert graph["pkg.f"] == {"pkg.e"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
    assert find_cycles(_graph_of(tmp_path / "3", sources)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_no_import_cycles():
    """None at module level, and none closed by a lazy import either."""
    cycles = find_cycles(import_graph(lazy=True))
    assert not cycles, "import cycles in kvflow (lazy imports counted):\n" + format_cycles(cycles)


# --- layers: which part of kvflow stands above which (issue #27) ----------------------------

MAX_CLIMBS = 4


def part_graph(graph: dict[str, set[str]], package: str = PACKAGE) -> dict[str, set[str]]:
    """The graph between kvflow's parts: each direct child of the package (a module such as
    ``config``, or a subpackage such as ``core``) is one node; ``a -> b`` when a module of
    ``a`` imports one of ``b``. Imports of the package's own ``__init__`` are left out."""
    def part(module: str) -> str | None:
        pieces = module.split(".")
        return pieces[1] if len(pieces) > 1 else None

    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        a = part(module)
        if a is None:
            continue
        parts.setdefault(a, set())
        for target in targets:
            b = part(target)
            if b is not None and b != a:
                parts[a].add(b)
    return parts


def layering(parts: dict[str, set[str]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Stand every part above what it imports, with as few edges as possible running back
    up ("climbs"), and number the layers.

    Within each strongly connected component (parts that import each other, directly or
    through others), the parts are ordered bottom to top so that the fewest imports point
    from a lower part to a higher one (an exact minimum feedback arc set, by dynamic
    programming over the subsets of the component; they are small); those imports are the
    climbs. Without them the graph is acyclic, and a part's layer is the longest chain of
    imports below it (0: imports nothing of kvflow).

    Returns:
        (part -> layer, the climbs as (importing part, imported part), sorted).
    """
    cycles = find_cycles(parts)
    climbs: list[tuple[str, str]] = []
    for cycle in cycles:
        members = sorted({p for c in [cycle] for p in c} | _component_of(parts, cycle[0]))
        n = len(members)
        if n > 16:
            raise AssertionError(f"a cycle of {n} parts is too large to order exactly: {members}")
        at = {p: i for i, p in enumerate(members)}
        imports = [[w in parts[v] for w in members] for v in members]
        best, choice = {0: 0}, {}
        for subset in sorted(range(1 << n), key=lambda m: bin(m).count("1")):
            if subset not in best:
                continue
            for j in range(n):
                if subset >> j & 1:
                    continue
                # j goes right above the parts of ``subset``: their imports of j climb
                cost = best[subset] + sum(imports[i][j] for i in range(n) if subset >> i & 1)
                nxt = subset | 1 << j
                if cost < best.get(nxt, 1 << 30):
                    best[nxt], choice[nxt] = cost, (subset, j)
        order, subset = [], (1 << n) - 1
        while subset:
            subset, j = choice[subset]
            order.append(members[j])
        rank = {p: i for i, p in enumerate(reversed(order))}  # bottom first
        climbs += [(v, w) for v in members for w in parts[v] if w in at and rank[w] > rank[v]]
    climbs = sorted(set(climbs))
    down = {v: parts[v] - {w for u, w in climbs if u == v} for v in parts}
    layer: dict[str, int] = {}

    def height(v: str) -> int:
        if v not in layer:
            layer[v] = 1 + max((height(w) for w in down[v]), default=-1)
        return layer[v]

    for v in sorted(parts):
        height(v)
    return layer, climbs


def _component_of(graph: dict[str, set[str]], start: str) -> set[str]:
    """The strongly connected component of ``start``."""
    def reach(g: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in g[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    reverse: dict[str, set[str]] = {v: set() for v in graph}
    for v, ws in graph.items():
        for w in ws:
            reverse[w].add(v)
    return reach(graph) & reach(reverse)


def test_layering_counts_the_fewest_climbs():
    parts = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "b"}, "e": set()}
    layer, climbs = layering(parts)
    assert len(climbs) == 1 and climbs[0] in {("a", "b"), ("b", "c"), ("c", "a")}
    assert layer["e"] == 0 and layer["d"] == max(layer["a"], layer["b"]) + 1
    two = {"x": {"y"}, "y": {"x"}, "z": {"x", "y"}}
    assert len(layering({**two, "w": {"z"}, "z": {"x", "y", "w"}})[1]) == 2


def test_no_circles_counting_type_only_imports_and_at_most_four_climbs():
    """Type-only and lazy imports count: no module circle, and at most ``MAX_CLIMBS``
    imports between parts run back up from a lower part to a higher one."""
    graph = import_graph(lazy=True, type_only=True)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (type-only and lazy imports counted):\n" + format_cycles(cycles)
    layer, climbs = layering(part_graph(graph))
    assert len(climbs) <= MAX_CLIMBS, "imports running back up:\n" + "\n".join(
        f"{a} (layer {layer[a]}) -> {b} (layer {layer[b]})" for a, b in climbs)


if __name__ == "__main__":
    status = 0
    for lazy in (False, True):
        found = find_cycles(import_graph(lazy=lazy))
        status |= bool(found)
        print(f"{'with lazy imports' if lazy else 'module level'}: {format_cycles(found) if found else 'no cycles'}")
    full = import_graph(lazy=True, type_only=True)
    found = find_cycles(full)
    print(f"with lazy and type-only imports: {format_cycles(found) if found else 'no cycles'}")
    parts = part_graph(full)
    layer, climbs = layering(parts)
    print(f"{len(parts)} parts on {max(layer.values()) + 1} layers, {sum(map(len, parts.values()))} imports "
          f"between parts, {len(climbs)} running back up:")
    for a, b in climbs:
        print(f"  {a} (layer {layer[a]}) -> {b} (layer {layer[b]})")
    for level in sorted(set(layer.values())):
        print(f"  layer {level}: {' '.join(sorted(p for p in parts if layer[p] == level))}")
    sys.exit(status or len(climbs) > MAX_CLIMBS)
