"""The package's shape: layers that import only downwards, torch-free parts, public names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import conveyor

PACKAGE = Path(conveyor.__file__).parent
# Each layer may import the ones before it, never one after it. The two faces, the
# modules ``gpipe`` and ``pipeline``, stand side by side on one layer.
LAYERS = ["errors|torchprivate", "schedules", "engine", "graph", "distributed", "tensor",
          "runtime", "gpipe|pipeline|decoding|balance|skip", "observe", "planner", "checking",
          "train", "cli|integrations"]
ROOMS = ["schedules", "engine", "graph", "distributed", "tensor", "runtime", "observe",
         "planner", "checking", "train", "cli", "integrations"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The conveyor modules ``path`` imports (inside functions too, unless told not to)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.split(".")[0] == "conveyor"}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    found = [i for i, layer in enumerate(LAYERS) if parts[1] in layer.split("|")]
    return found[0] if found else None


def test_the_top_level_shows_the_layers() -> None:
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    packages = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    assert sorted(packages) == sorted(ROOMS)
    assert set(entries) == {*ROOMS, "errors.py", "torchprivate.py", "gpipe.py", "pipeline.py",
                            "decoding.py", "balance.py", "skip.py", "__init__.py", "__main__.py",
                            "py.typed"}
    for name in packages:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc, f"conveyor/{name}/__init__.py says nothing about what lives there"


def test_every_import_points_down_the_layers() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        own = _layer(name)
        if own is None:
            continue
        for imported in _imports(path, top_level_only=False):
            other = _layer(imported)
            if other is not None and other > own:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "imports pointing up the layers:\n" + "\n".join(wrong)


def test_no_module_import_cycle() -> None:
    """Every import counts: top-level, inside functions, under ``TYPE_CHECKING``."""
    modules = _modules()

    def target(imported: str) -> str | None:  # the module an imported name lives in
        while imported and imported not in modules:
            imported = imported.rpartition(".")[0]
        return imported or None

    graph = {name: {t for i in _imports(path, top_level_only=False)
                    if (t := target(i)) is not None and t != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if nxt == "conveyor" or nxt.startswith(name + "."):
                continue  # a package re-exporting its own modules
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, name, nxt]))
            if nxt not in state:
                visit(nxt, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert len(state) == len(modules) > 30


def test_the_cycle_check_sees_imports_in_functions_and_type_checking(tmp_path: Path) -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from conveyor.pipeline import Pipeline\n"
              "def f():\n    from conveyor.engine import stage\n")
    (tmp_path / "m.py").write_text(source)
    assert _imports(tmp_path / "m.py", top_level_only=False) >= {
        "conveyor.pipeline.Pipeline", "conveyor.engine.stage"}


def test_rooms_modules_and_functions_stay_small() -> None:
    """STYLE's numbers: no room (a folder) over 16 modules, no module over 400 lines, no
    function body over 60 lines (docstring aside)."""
    for folder in sorted({path.parent for path in PACKAGE.rglob("__init__.py")}):
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 16, f"{folder.relative_to(PACKAGE.parent)} holds {len(modules)}"
    for path in _modules().values():
        source = path.read_text()
        lines = len(source.splitlines())
        assert lines <= 400, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                documented = isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and len(body) > 1
                start = body[1 if documented else 0].lineno
                assert node.end_lineno is not None
                length = node.end_lineno - start + 1
                assert length <= 60, f"{path.relative_to(PACKAGE.parent)}: {node.name} " \
                                     f"runs {length} lines"


def _environment_writes(tree: ast.AST) -> list[int]:
    """Lines that change ``os.environ`` (item assignment or deletion, ``setdefault``,
    ``update``, ``pop``, ``clear``) or call ``os.putenv`` / ``os.unsetenv``."""
    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        if any(isinstance(t, ast.Subscript) and is_environ(t.value) for t in targets):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                (is_environ(node.func.value) and node.func.attr in
                 ("setdefault", "update", "pop", "clear", "__setitem__", "__delitem__"))
                or node.func.attr in ("putenv", "unsetenv")):
            found.append(node.lineno)
    return sorted(found)


def test_the_library_never_writes_the_environment() -> None:
    """A pipeline is told where it runs (``topology=``), never by rewriting the process's
    environment. The one write is the command line's own process set-up, before torch
    loads: an OpenMP default (as torchrun sets OMP_NUM_THREADS)."""
    writes = {name: lines for name, path in _modules().items()
              if (lines := _environment_writes(ast.parse(path.read_text())))}
    assert set(writes) <= {"conveyor.cli.main"}, writes
    assert len(writes.get("conveyor.cli.main", [])) == 1
    sample = ast.parse("import os\nos.environ['A'] = '1'\nos.environ.update(B='2')\n"
                       "del os.environ['A']\nos.putenv('C', '3')\nx = os.environ.get('D')\n")
    assert _environment_writes(sample) == [2, 3, 4, 5]


#: torch.distributed's collectives and point-to-point calls, which wait as long as the
#: process group's timeout unless the caller bounds them.
COLLECTIVES = {"all_reduce", "broadcast", "barrier", "monitored_barrier", "all_gather",
               "all_gather_into_tensor", "all_gather_object", "broadcast_object_list",
               "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "batch_isend_irecv"}
#: Where they may be called: the bounded collectives, and the wire, whose receives a
#: watcher or the long waits' thread bounds (sends complete or fail with their receive;
#: that thread's own receive is waited for 10 ms, to cut a wait that went silent).
BOUNDED = {"conveyor.distributed.faults.collective": {"all_reduce", "broadcast", "all_gather"},
           "conveyor.distributed.p2p": {"isend"},
           "conveyor.distributed.receiving": {"irecv"},
           "conveyor.distributed.longwaits": {"irecv"}}


def test_every_collective_is_bounded() -> None:
    """Every collective conveyor makes goes through conveyor.distributed.faults.collective
    (a bounded wait that names the rank that did not come), never torch's directly."""
    found = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "dist" \
                    and node.func.attr in COLLECTIVES \
                    and node.func.attr not in BOUNDED.get(name, set()):
                found.setdefault(name, []).append(f"{node.func.attr} (line {node.lineno})")
    assert not found, found


def test_the_pipeline_face_imports_from_few_modules() -> None:
    """``pipeline.py`` is a face: what it builds is ``runtime/``'s. Of its modules, most
    give only the types of its signature."""
    imported = {name for name in _imports(_modules()["conveyor.pipeline"],
                                          top_level_only=False)
                if name in _modules()}
    assert len(imported) <= 13, sorted(imported)


@pytest.mark.parametrize("module", ["conveyor", "conveyor.schedules", "conveyor.schedules.simulate",
                                    "conveyor.schedules.timeline",
                                    "conveyor.train.options", "conveyor.train.outdir",
                                    "conveyor.cli"])
def test_modules_that_import_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_no_import_hook_and_no_short_paths() -> None:
    """Every module path is a file: ``conveyor.simulate`` is ``conveyor.schedules.simulate``."""
    import sys

    assert not [finder for finder in sys.meta_path
                if type(finder).__module__.startswith("conveyor")]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("conveyor.simulate")


@pytest.mark.parametrize("module", ["conveyor.errors", "conveyor.train.errors"])
def test_every_public_error_is_exported_from_the_package(module: str) -> None:
    errors = importlib.import_module(module)
    classes = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, Exception)
               and value.__module__ == module}
    assert classes == set(errors.__all__) and classes <= set(conveyor.__all__)
    for name in classes:
        assert getattr(conveyor, name) is getattr(errors, name)


def test_errors_live_in_the_errors_modules() -> None:
    """The library's errors in ``errors.py``, the training app's in ``train/errors.py``."""
    import conveyor.errors as errors
    import conveyor.train.errors as train_errors

    assert {"NonFiniteLossError", "PeerFailure", "ConfigError"} <= set(errors.__all__)
    assert set(train_errors.__all__) == {"CheckpointError"}
    assert train_errors.SaveError is errors.SaveError  # the library's: export raises it too
    raised = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", "").endswith(("Error", "Failure")) for b in node.bases):
                raised.add(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert raised and all(where.startswith(("errors.py:", "train/errors.py:"))
                          for where in raised), raised


# Modules whose names users import; elsewhere __all__ lists only names of ``conveyor``.
PUBLIC_MODULES = {"conveyor", "conveyor.errors", "conveyor.train.errors", "conveyor.cli",
                  "conveyor.cli.main", "conveyor.balance", "conveyor.skip",
                  "conveyor.graph.source", "conveyor.integrations.transformers"} | {
    name for name in _modules() if name.startswith(("conveyor.schedules", "conveyor.planner"))} | {
    f"conveyor.{short}" for short in ("observe.simulate", "observe.trace", "observe.plan",
                                      "train.models", "train.data", "train.saving")}


def test_internal_modules_show_no_public_names_of_their_own() -> None:
    for name in _modules():
        if name in PUBLIC_MODULES or name == "conveyor.__main__":  # that one runs the command
            continue
        module = importlib.import_module(name)
        assert hasattr(module, "__all__"), f"{name} has no __all__"
        extra = set(module.__all__) - set(conveyor.__all__)
        assert not extra, f"{name} exports {sorted(extra)}, which conveyor does not"


def test_public_names_all_resolve() -> None:
    assert len(set(conveyor.__all__)) == len(conveyor.__all__) > 0  # each listed once
    missing = [name for name in conveyor.__all__ if not hasattr(conveyor, name)]
    assert not missing, f"conveyor.__all__ lists names the package lacks: {missing}"


def test_sub_faces_hold_their_families_and_old_flat_names_warn() -> None:
    """``conveyor.balance`` and ``conveyor.skip`` (as torchgpipe's); the flat names they
    replace keep working for a release, with a DeprecationWarning naming the new one."""
    import conveyor.balance
    import conveyor.skip

    assert conveyor.balance.__all__ and conveyor.skip.__all__
    assert not set(conveyor.balance.__all__ + conveyor.skip.__all__) & set(conveyor.__all__)
    for face in (conveyor.balance, conveyor.skip):
        for name in face.__all__:
            with pytest.warns(DeprecationWarning, match=rf"conveyor\.{face.__name__[9:]}\.{name}"):
                assert getattr(conveyor, name) is getattr(face, name)
    assert len(conveyor.__all__) - len(conveyor.errors.__all__) <= 25
