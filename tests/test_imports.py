"""How the package's modules import each other: no import circles (an import inside a
function counts too), an import inside a function only where it says why (``# lazy:``),
and the serving path never reaching draft training."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folder -> installed package name (pyproject's package-dir mapping).
PACKAGES = {"specserve": "specserve", "drafts": "specserve.drafts", "kernels": "specserve.kernels"}
SERVING = ("specserve.engine", "specserve.async_engine", "specserve.server", "specserve.server.app", "specserve.cli")


def module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Every module's dotted name and file."""
    modules = {}
    for folder, package in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, ast.stmt, bool]]:
    """The package's modules ``name`` imports, each with its statement and whether it sits
    inside a function; ``from package import module`` counts as importing the module."""
    tree = ast.parse(path.read_text())
    inside = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node, id(node) in inside))
    return found


def import_graph(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: {target for target, _, _ in imports_of(name, path, modules)} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, set[str]], starts) -> set[str]:
    seen, todo = set(), list(starts)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return seen


def test_the_package_has_no_import_circles_counting_imports_inside_functions():
    assert cycles(import_graph()) == []


def test_a_circle_closed_inside_a_function_is_found(tmp_path):
    """The check can fail: two modules that import each other, one only inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph["pkg.c"] == {"pkg.a"}  # relative imports resolve
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_imports_inside_functions_say_why():
    """Only what must stay out of a module's import (a heavy or optional library: triton,
    fastapi, transformers' model classes) is imported inside a function, with a
    ``# lazy:`` comment on its line or in the comment just above it (or above the group of
    imports it belongs to) saying why."""
    modules = module_files(ROOT, PACKAGES)
    unexplained = []
    for name, path in modules.items():
        lines = path.read_text().splitlines()
        for _, node, inside in imports_of(name, path, modules) + _third_party_imports(path):
            if inside and "# lazy:" not in _with_comment_above(lines, node.lineno - 1):
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert unexplained == []


def _with_comment_above(lines: list[str], i: int) -> str:
    """Line ``i`` and the comment and import lines right above it."""
    start = i
    while start > 0 and lines[start - 1].strip().startswith(("#", "from ", "import ")):
        start -= 1
    return "\n".join(lines[start:i + 1])


def _third_party_imports(path: Path) -> list[tuple[str, ast.stmt, bool]]:
    """Imports of other packages inside functions."""
    tree = ast.parse(path.read_text())
    return [("", node, True) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))
            and not (getattr(node, "module", None) or node.names[0].name).startswith("specserve")]


def test_the_serving_path_never_imports_draft_training():
    graph = import_graph()
    assert not [m for m in reachable(graph, SERVING) if m.startswith("specserve.training")]
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, specserve.cli, specserve.server.app; "
                               "print(sorted(m for m in sys.modules if m.startswith('specserve.training')))"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_a_clone_root_on_the_path_does_not_shadow_the_hub_kernels_package():
    """``python -m``/``-c`` run in a clone's root put it on ``sys.path``, where the top-level
    ``kernels/`` folder (installed as ``specserve.kernels``) would shadow the Hugging Face
    ``kernels`` package that transformers imports when installed: that package is loaded in
    its place, so a checkpoint's config still loads; without it, ``kernels`` stays the
    folder (what transformers then finds and leaves alone)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    code = ("import kernels, specserve.kernels as ours; print(kernels.__file__); print(ours.__file__); "
            "import transformers; transformers.AutoConfig.for_model('llama'); print('config')")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    hub = importlib.util.find_spec("kernels") is not None and \
        not str(importlib.util.find_spec("kernels").origin).startswith(str(root))
    if hub:
        assert done.returncode == 0, done.stderr[-2000:]
        theirs, ours, loaded = done.stdout.split()
        assert not theirs.startswith(str(root)) and ours == str(root / "kernels" / "__init__.py")
        assert loaded == "config"
    else:
        assert done.returncode == 0, done.stderr[-2000:]
        theirs, ours, loaded = done.stdout.split()
        assert theirs == ours == str(root / "kernels" / "__init__.py") and loaded == "config"
