"""The shape of the code: imports inside src/eaglespec run one way (no cycle, read with ast), and the
README's layout table names every module as its docstring describes it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "eaglespec"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in the file, lazy imports included)."""
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
            else:
                continue
            for t in targets:
                while t and t not in files:  # `from pkg import name`: the module pkg.name, else pkg
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "eaglespec"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text("from eaglespec import a\nx = 1\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert cycles(import_graph(pkg)) == [["eaglespec.a", "eaglespec.c", "eaglespec.sub.b"]]


def test_no_import_cycle_in_the_package():
    found = cycles(import_graph())
    assert not found, "import cycles (modules that import each other, lazy imports included): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_readme_layout_table_names_every_module():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs" / "layout.py"), "--check"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    readme = (ROOT / "README.md").read_text()
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py" or path.read_text().strip():
            assert f"`{path.relative_to(PACKAGE).as_posix()}`" in readme, path
