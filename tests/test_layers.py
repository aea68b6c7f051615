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


def _circles(modules: dict[str, pathlib.Path], package: str, layer: str | None = None) -> list[list[str]]:
    """The import circles among the modules of ``package`` (of one ``layer`` of it, if given; every import counts:
    inside functions and under ``TYPE_CHECKING`` too), each as its modules' names, sorted."""
    fronts = {"tierstore", "tierstore.integrations", "tierstore.tools"}  # each __init__ re-exports its package
    mine = {m for m in modules
            if m.startswith(package + ".") and m not in fronts and (layer is None or _layer(m) == layer)}
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


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_module_imports_one_that_imports_it(layer):
    """In every layer, each module is given what it uses instead of importing the one above it (the levels of an
    offload are built with the store, their compute site, the pass and the schedule, never the front: see [Note:
    The levels below the front]; the transformers adapter attaches itself to the generic offload, which imports no
    adapter); no circle, type-checking imports included."""
    assert _circles(_MODULES, "tierstore", layer) == []


def test_the_check_sees_a_circle_through_a_type_checking_import(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n")
    (tmp_path / "c.py").write_text("from .a import f\n")
    modules = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert _circles(modules, "pkg") == [["pkg.a", "pkg.b"]]


def test_the_check_sees_a_circle_in_the_core(tmp_path):
    (tmp_path / "_a.py").write_text("def f():\n    from ._b import g\n")
    (tmp_path / "_b.py").write_text("from ._a import f\n")
    (tmp_path / "_c.py").write_text("from ._a import f\n")
    modules = {f"tierstore.{n}": tmp_path / f"{n}.py" for n in ("_a", "_b", "_c")}
    assert _circles(modules, "tierstore", "core") == [["tierstore._a", "tierstore._b"]]


def _private_names(path: pathlib.Path, name: str) -> list[str]:
    """Private names (``_x``) that ``path`` (module ``name``) imports from another module of the project: a name
    a module keeps to itself is not another file's to use (a private *module* of the same package is imported as
    a module: that is :func:`_private_imports`'s to judge)."""
    out = []
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = package.split(".")
        target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
            if node.level else node.module or ""
        if _layer(target) is None:
            continue
        out += [f"line {node.lineno}: {a.name} from {target}" for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__") and f"{target}.{a.name}" not in _MODULES]
    return out


@pytest.mark.parametrize("folder, package", [("tierstore", "tierstore"), ("integrations", "tierstore.integrations"),
                                             ("tierstore/tools", "tierstore.tools"), ("perf", "perf"),
                                             ("examples", "examples")])
def test_no_module_imports_another_modules_private_names(folder, package):
    found = {p.name: _private_names(p, package if p.stem == "__init__" else f"{package}.{p.stem}")
             for p in sorted((ROOT / folder).glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}


def test_the_check_sees_a_private_name(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from .checkpoint import _offloaded, load_checkpoint\nfrom . import _native\n"
                    "from tierstore._config import _ds_int\nfrom torch._C import _get_tracing_state\n")
    assert _private_names(path, "tierstore.integrations.probe") == [
        "line 1: _offloaded from tierstore.integrations.checkpoint", "line 3: _ds_int from tierstore._config"]


_DYNAMIC = ("importlib", "__import__", "entry_points", "import_module")


def _dynamic_imports(path: pathlib.Path) -> list[str]:
    """Where ``path`` imports a module chosen at run time (importlib, ``__import__``, entry points): an import
    that the checks of direction above cannot see."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        out += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in _DYNAMIC]
    return sorted(set(out))


def test_the_core_imports_nothing_chosen_at_run_time():
    """The core imports no module by a name it is given or finds (an entry point, importlib): it could reach a layer
    above it unseen (see [Note: Settings of the layers above])."""
    found = {p.name: _dynamic_imports(p) for p in sorted((ROOT / "tierstore").glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}


def test_the_check_sees_a_dynamic_import(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import importlib.metadata\n\ndef f():\n    return __import__('tierstore.integrations')\n\n"
                    "def g(m):\n    for ep in m.entry_points(group='x'):\n        ep.load()\n")
    assert _dynamic_imports(path) == ["line 1: importlib.metadata", "line 4: __import__", "line 7: entry_points"]


# [Note: The levels below the front] An offload's levels (each parameter's StoredParam, each module's Unit, the
# model's PassState, the forwards it wraps, the units' schedule) are built with what they use: the store, the
# compute site, the pass, the schedule, their records. None holds the front (OffloadedModel / FSDPOffload), so
# none can reach sideways through it; what reacts to the pass is reached through the typed consumer interface
# (``_contract.Consumers``), whose members are the levels above and are not walked.

def _reaches(starts: dict[str, object], target: object) -> list[str]:
    """The paths from ``starts`` by which ``target`` is reachable through the project's own objects: their
    attributes, the containers, bound methods, partials, closures and weak references they hold. Modules, the
    store, tensors other than offloaded parameters, hook handles and the attached consumers are where a walk
    stops: they are given to the levels, not part of them."""
    import functools
    import types
    import weakref

    from torch import nn

    from tierstore import TierStore
    from tierstore.integrations._contract import PassConsumer

    found, seen = [], set()
    todo = list(starts.items())
    while todo:
        path, obj = todo.pop()
        if obj is target:
            found.append(path)
            continue
        if id(obj) in seen or isinstance(obj, (nn.Module, TierStore, PassConsumer, type, types.ModuleType)):
            continue
        seen.add(id(obj))
        children: list[tuple[str, object]] = []
        if isinstance(obj, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in obj.items()] + [(f"{path}.key", k) for k in obj]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, types.MethodType):
            children = [(f"{path}.__self__", obj.__self__)]
        elif isinstance(obj, functools.partial):
            children = [(f"{path}.func", obj.func), (f"{path}.args", obj.args), (f"{path}.keywords", obj.keywords)]
        elif isinstance(obj, types.FunctionType):
            children = [(f"{path}.<closure>", c.cell_contents) for c in obj.__closure__ or ()
                        if c.cell_contents is not None]
        elif isinstance(obj, weakref.ref):
            children = [(f"{path}()", obj())]
        elif type(obj).__module__.startswith("tierstore"):
            fields = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                fields.update({s: getattr(obj, s) for s in getattr(cls, "__slots__", ()) if hasattr(obj, s)})
            children = [(f"{path}.{k}", v) for k, v in fields.items()]
        todo += children
    return sorted(found)


def _levels(off) -> dict[str, object]:
    """The levels below the front: its pass, schedule, compute site, parameter records, units and the forwards
    it put on the model's modules (a unit's own wrapper, or the model's)."""
    levels: dict[str, object] = {"pass_state": off.pass_state, "schedule": off.schedule, "site": off.site}
    levels.update({f"params[{sp.name!r}]": sp for sp in off.params.values()})
    levels.update({f"units[{u.name!r}]": u for u in off.schedule.units.values()})
    levels.update({f"forward of {n!r}": m.__dict__["forward"] for n, m in off.model.named_modules()
                   if getattr(m.__dict__.get("forward"), "__globals__", {}).get("__name__", "").startswith("tierstore")})
    return levels


def _tiny_offload(tmp_path):
    import torch

    from tierstore import TierStore
    from tierstore.integrations import OffloadedAdamW, offload_model

    store = TierStore(nvme_path=str(tmp_path), host_budget_bytes=1 << 20, device_budget_bytes=1 << 20,
                      file_size_bytes=1 << 20, block_size_bytes=64 * 1024)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-3)
    model(torch.randn(8, 64)).square().mean().backward()  # the pass's lazily made parts exist now
    opt.step()
    opt.zero_grad()
    return store, off, opt


def test_no_level_below_the_front_holds_the_front(tmp_path):
    """Built, trained a step, stepped: every level of the offload is walked, and the front is not reached."""
    store, off, opt = _tiny_offload(tmp_path)
    try:
        levels = _levels(off)
        assert len([k for k in levels if k.startswith("units[")]) >= 2 and any(k.startswith("forward") for k in levels)
        assert _reaches(levels, off) == []
    finally:
        off.remove(keep_values=False)  # drops the optimizer's state too
        store.close()


def test_the_check_sees_a_level_that_holds_the_front(tmp_path):
    """A unit given the front as an attribute, a schedule holding one of its bound methods, and a parameter
    record holding it weakly are each found."""
    import weakref

    store, off, opt = _tiny_offload(tmp_path)
    try:
        unit = next(iter(off.schedule.units.values()))
        unit.owner = off
        off.schedule.later = [off.remove]
        sp = next(iter(off.params.values()))
        sp.front = weakref.ref(off)
        found = _reaches(_levels(off), off)
        # each under the first path the walk takes to it (the forward's closure reaches the schedule first)
        assert len(found) == 3, found
        assert any(path.endswith(f"units[{unit.name!r}].owner") for path in found), found
        assert any(path.endswith("schedule.later[0].__self__") for path in found), found
        assert any(path.endswith(".front()") for path in found), found
        del unit.owner, off.schedule.later, sp.front
        assert _reaches(_levels(off), off) == []
    finally:
        off.remove(keep_values=False)  # drops the optimizer's state too
        store.close()
