"""photon_core/megakernel is a tree of imports: each op's rules import the graph, the step graph
and the plan's layout, never the kernel or the compiler; the kernel assembles the op codes; the
compiler plans. Every import counts, at module level, inside functions and under TYPE_CHECKING
(each is a dependency a reader has to hold in mind); the package's __init__, which gathers the
public names, is left out."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "photon_core.megakernel"


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports (a `from package import name` of a submodule is that
    submodule; of anything else, the package itself)."""
    me = module_of(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != me}


def graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "photon_core" / "megakernel").rglob("*.py"))
    modules = {module_of(f) for f in files}
    return {module_of(f): imports(f, modules) - {PKG} for f in files if module_of(f) != PKG}


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]) if n in path
                                     else f"import cycle through {n}")
            if n not in state:
                visit(n, path + [n])
        state[m] = 2
    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_no_op_imports_the_kernel_or_the_compiler():
    for m, deps in graph().items():
        if m.startswith(f"{PKG}.ops"):
            assert not deps & {f"{PKG}.kernel", f"{PKG}.compiler"}, (m, sorted(deps))


def test_the_graph_sees_every_import():
    # the analysis itself: the compiler imports the ops, the kernel the graph
    g = graph()
    assert f"{PKG}.ops" in g[f"{PKG}.compiler"] and f"{PKG}.graph" in g[f"{PKG}.kernel"]
    assert f"{PKG}.layout" in g[f"{PKG}.ops.base"]          # its TYPE_CHECKING import counts too
