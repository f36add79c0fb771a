"""The product and the lab apart: the product (fate_rdma, easypyverbs) never imports the lab (fate_rdma_lab),
and the import graph of all three has no cycle, type-only imports included. Read from the source (no import
is run), so a function-level import or one under `if TYPE_CHECKING:` counts as much as a top-level one."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("fate_rdma", "easypyverbs")
LAB = ("fate_rdma_lab",)


def modules() -> Dict[str, Path]:
    out: Dict[str, Path] = {}
    for top in PRODUCT + LAB:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """The project modules `name` imports (the closest known module of each imported name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = set()
    for t in targets:
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name:
            found.add(t)
    return found


def graph() -> Dict[str, Set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_tree_has_all_three_packages() -> None:
    g = graph()
    for top in PRODUCT + LAB:
        assert top in g, f"{top} not found at the repository root"
    assert any(m.startswith("fate_rdma_lab.bench.") for m in g) and any(m.startswith("fate_rdma.channel.") for m in g)


def test_the_product_never_imports_the_lab() -> None:
    bad = sorted(f"{m} -> {t}" for m, ts in graph().items() if m.split(".")[0] in PRODUCT
                 for t in ts if t.split(".")[0] in LAB)
    assert not bad, "product modules import the lab:\n" + "\n".join(bad)


def test_the_import_graph_has_no_cycle() -> None:
    g = graph()
    # Tarjan's strongly connected components; a component of more than one module is a cycle
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    cycles: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_is_seen(tmp_path: Path) -> None:
    """The checker itself: two modules importing each other (one of them only inside a function) are found."""
    (tmp_path / "a.py").write_text("from b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import y\n")
    known = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert imports_of("a", known["a"], known) == {"b"} and imports_of("b", known["b"], known) == {"a"}
