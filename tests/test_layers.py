"""Imports run one way: the tools (``tierstore.tools``) may use the integrations (``tierstore.integrations``) and
the core (the rest of ``tierstore``); the integrations only the core; the core neither. Every import statement
counts, also those inside functions."""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = {"core": 0, "integrations": 1, "tools": 2}


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, for every module of the three layers."""
    out = {}
    for package, folder in (("tierstore", ROOT / "tierstore"), ("tierstore.integrations", ROOT / "integrations"),
                            ("tierstore.tools", ROOT / "tierstore" / "tools")):
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _layer(module: str) -> str | None:
    if module == "tierstore.integrations" or module.startswith("tierstore.integrations."):
        return "integrations"
    if module == "tierstore.tools" or module.startswith("tierstore.tools."):
        return "tools"
    if module == "tierstore" or module.startswith("tierstore."):
        return "core"
    return None  # outside the project


def _imports(name: str, path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from tierstore import tools`` names a module too
            found += [(node.lineno, target)] + [(node.lineno, f"{target}.{a.name}") for a in node.names
                                                if f"{target}.{a.name}" in _MODULES]
    return found


_MODULES = _modules()


def test_the_three_layers_exist():
    assert {_layer(m) for m in _MODULES} == set(LAYERS)
    assert "tierstore.tools.cli" in _MODULES and "tierstore.integrations.offload" in _MODULES


@pytest.mark.parametrize("name", sorted(_MODULES))
def test_imports_run_one_way(name):
    mine = _layer(name)
    upward = [f"line {line}: {target}" for line, target in _imports(name, _MODULES[name])
              if (theirs := _layer(target)) is not None and LAYERS[theirs] > LAYERS[mine]]
    assert not upward, f"{name} ({mine}) imports from a layer above it: {upward}"
    importlib.import_module(name)


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from .tools.demo import run_demo\n    from tierstore.integrations import x\n")
    assert [t for _, t in _imports("tierstore.probe", path)] == ["tierstore.tools.demo", "tierstore.integrations"]


def _private_imports(path: pathlib.Path, package: str) -> list[str]:
    """Imports in ``path`` (a module of ``package``) of a private module of another package of the project:
    ``tierstore._x`` from outside the core, ``tierstore.integrations._x`` from outside the integrations."""
    name = f"{package}.{path.stem}"
    out = []
    for line, target in _imports(name, path):
        parts = target.split(".")
        for depth in range(1, len(parts)):
            owner, leaf = ".".join(parts[:depth]), parts[depth]
            if owner in ("tierstore", "tierstore.integrations") and leaf.startswith("_") and owner != package:
                out.append(f"line {line}: {target}")
                break
    return out


@pytest.mark.parametrize("folder, package", [("integrations", "tierstore.integrations"),
                                             ("tierstore/tools", "tierstore.tools"), ("perf", "perf"),
                                             ("examples", "examples")])
def test_the_layers_above_use_only_public_names(folder, package):
    """The core's public modules (tierstore, .memory, .scheduling, .files, .swap) and the integrations' (those
    without a leading underscore) are the whole API between the layers: no private module of a layer below is
    imported from above it, so a change inside the core cannot break an integration without a public name
    changing. Tests may reach in."""
    found = {p.name: _private_imports(p, package) for p in sorted((ROOT / folder).glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}


def test_the_check_sees_a_private_import(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from tierstore._memory import TierPool\nfrom tierstore.integrations import _layouts\n"
                    "from tierstore.memory import TierPool\nfrom .flags import DTYPES\n")
    assert _private_imports(path, "tierstore.tools") == ["line 1: tierstore._memory",
                                                         "line 2: tierstore.integrations._layouts"]
    # the integrations' own private modules are theirs to import
    assert _private_imports(path, "tierstore.integrations") == ["line 1: tierstore._memory"]


def _circles(modules: dict[str, pathlib.Path], package: str) -> list[list[str]]:
    """The import circles among the modules of ``package`` (every import counts: inside functions and under
    ``TYPE_CHECKING`` too), each as its modules' names, sorted."""
    mine = {m for m in modules if m.startswith(package + ".")}
    graph = {m: {t for _, t in _imports(m, modules[m]) if t in mine and t != m} for m in mine}
    circles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_of_the_integrations_imports_one_that_imports_it():
    """Each level of an offload is given what it uses (``_contract.ModelOffload``, a protocol) instead of
    importing the level above it; no circle, type-checking imports included."""
    assert _circles(_MODULES, "tierstore.integrations") == []


def test_the_check_sees_a_circle_through_a_type_checking_import(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n")
    (tmp_path / "c.py").write_text("from .a import f\n")
    modules = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert _circles(modules, "pkg") == [["pkg.a", "pkg.b"]]
