"""The package's layers, enforced: imports point down, no circles, no private names taken.

Layers, from the bottom (a module may import from its own layer and those below):

0. ``errors``, ``_settings``, ``_threads``, ``_liveness``, ``_device``, ``_cpu``,
   ``_version``: nothing of the package above them.
1. ``_format``: the container, codecs, the object tree, the sharded index.
2. ``_storage``: backends over a filesystem.
3. ``_engine``: snapshot, encode, decode, the writer process, compression choice, overlap.
4. ``_versions``: versioned roots: records on storage, lease and commit, reading, markers.
5. ``_api``: ``save``/``load``, ``Checkpointer``, the job runtime.
6. integrations: ``dcp``, ``lightning``, ``accelerate``, ``transformers``, ``_convert``.
7. the package's face and tools: ``__init__``, ``__main__``, ``cli``, ``testing``.

See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asyncckpt"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

LAYERS: dict[str, int] = {
    "errors": 0,
    "_settings": 0,
    "_device": 0,
    "_cpu": 0,
    "_threads": 0,
    "_liveness": 0,
    "_version": 0,
    "_format": 1,
    "_storage": 2,
    "_engine": 3,
    "_versions": 4,
    "_api": 5,
    "dcp": 6,
    "lightning": 6,
    "accelerate": 6,
    "transformers": 6,
    "_convert": 6,
    "__init__": 7,
    "__main__": 7,
    "cli": 7,
    "testing": 7,
}


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken, line)`` for every import of the package's modules.

    The benchmarks import each other as top-level scripts (``from common import x``): a name
    that is not a known module is tried under the package's name too.
    """
    package = next(iter(known)).split(".")[0]

    def known_as(name: str) -> str:
        return (
            name
            if name in known or not name
            else next((c for c in (f"{package}.{name}",) if c in known), name)
        )

    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [known_as(a.name) for a in node.names]
            out += [(n, [], node.lineno) for n in names if n in known]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                target = ".".join(prefix + ([node.module] if node.module else []))
            else:
                target = known_as(node.module or "")
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            taken = [n for n in names if f"{target}.{n}" not in known]
            if target in known and taken:  # names of the module itself, not its submodules
                out.append((target, taken, node.lineno))
            out += [(s, [], node.lineno) for s in submodules]
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    if head not in LAYERS:
        raise AssertionError(f"{module} belongs to no layer: add its folder to LAYERS")
    return LAYERS[head]


MODULES = _modules(PACKAGE, "asyncckpt")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine = _layer(module)
    for target, _names, line in _imports(module, MODULES[module], MODULES):
        if target == module:
            continue
        theirs = _layer(target)
        assert theirs <= mine, (
            f"{MODULES[module]}:{line} imports {target} (layer {theirs}) from layer {mine}"
        )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_of_another_module(module: str) -> None:
    for target, names, line in _imports(module, MODULES[module], MODULES):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{MODULES[module]}:{line} takes private {private} from {target}"


def _cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Import cycles, counting imports for annotations only (``if TYPE_CHECKING:``) too: a
    type two modules name of each other means they are one stage, or miss a Protocol."""
    graph = {m: {t for t, _, _ in _imports(m, p, modules) if t != m} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package() -> None:
    assert _cycles(MODULES) == []


def test_no_import_cycle_in_the_benchmarks() -> None:
    assert _cycles(_modules(BENCHMARKS, "benchmarks")) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_says_its_one_job_in_its_first_line(module: str) -> None:
    """What a line count stood for: a module has one job, and says which before anything
    else, so a newcomer knows whether a change belongs in it."""
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text())) or ""
    assert doc.strip(), f"{MODULES[module]}: no docstring saying what the module is for"


def test_every_error_a_user_catches_lives_in_errors() -> None:
    """errors.py holds what users catch, each an AsyncCkptError (its docstring promises
    ``except asyncckpt.AsyncCkptError`` catches them all). An exception class elsewhere is
    an internal signal caught inside the package (the writer's "the copy failed", the
    command line's exit statuses): it derives from ``Exception`` alone, so it can neither
    pose as a user-facing error nor be caught as one."""
    import asyncckpt.errors as errors

    for name, value in vars(errors).items():
        if isinstance(value, type) and value.__module__ == errors.__name__:
            assert issubclass(value, (errors.AsyncCkptError, errors.AsyncCkptWarning)), name
    for module, path in MODULES.items():
        if module == "asyncckpt.errors":
            continue
        # Module-level classes: a class local to a function (the conformance suite's
        # stand-in for a caller's failure) is never raised to a user.
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Failed")) for b in bases):
                    assert bases == {"Exception"}, (
                        f"{path}:{node.lineno}: {node.name} derives from {sorted(bases)}: a "
                        "user-facing error belongs in errors.py, an internal one derives "
                        "from Exception alone"
                    )


def test_only_the_storage_layer_asks_a_backend_its_type() -> None:
    """What the engine, the protocol and the tools need to know of a backend (local paths,
    on a local disk, which device or store, picklable) are properties of ``Storage``: a
    new backend that sets them is treated right everywhere, with no ``isinstance`` to find."""
    import asyncckpt._storage as storage_layer

    names = {
        cls.__name__
        for module in vars(storage_layer).values()
        if isinstance(module, types.ModuleType)
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, storage_layer.Storage)
    } - {"Storage"}
    assert {"LocalStorage", "FsspecStorage", "S3Storage"} <= names
    backends = re.compile(r"isinstance\([^)]*\b(" + "|".join(sorted(names)) + r")\b")
    found = [
        f"{path}:{number}: {match.group(1)}"
        for module, path in MODULES.items()
        if not module.startswith("asyncckpt._storage")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in [backends.search(line)]
        if match
    ]
    assert not found, found


def _assigned_attributes(cls: ast.ClassDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def test_no_base_class_redeclares_the_attributes_of_a_class_built_on_it() -> None:
    """A base (a mixin) that declares the attributes a class of the package sets on it (so
    that a type checker accepts ``self.x`` in the base) is one class split in two files:
    its attributes live twice. (A mixin for a class outside the package, such as the
    Hugging Face trainer's, declares what it uses of that class and is not counted.)"""
    classes = {
        node.name: node
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    found = []
    for cls in classes.values():
        for base in cls.bases:
            parent = classes.get(getattr(base, "id", ""))
            if parent is None:
                continue
            declared = {
                item.target.id
                for item in parent.body
                if isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and item.value is None
            }
            if twice := sorted(declared & _assigned_attributes(cls)):
                found.append(f"{parent.name} declares what {cls.name} sets: {twice}")
    assert not found, found


#: The modules whose functions a user calls, each of which resolves the tunables once
#: (``Settings.resolve``/``Settings.of``: argument > environment > default) and hands the
#: object down: ``save``/``load``/``open``/``reserve``, ``Checkpointer(...)``, the DCP
#: writer and reader, the Lightning plugin, the Hugging Face trainer, the command line, and
#: the public functions of ``asyncckpt.cli`` (``load_ackpt``, ``save_ackpt``,
#: ``verify_file``), and the storage constructors a user calls to build a backend
#: (``LocalStorage()``, ``S3Storage(fs)``, e.g. for the conformance suite). ``_settings``
#: defines them.
SETTINGS_ENTRY_POINTS = {
    "asyncckpt._settings",
    "asyncckpt._api.dropin",
    "asyncckpt._api.checkpointer",
    "asyncckpt.dcp.writer",
    "asyncckpt._versions.dcp_reader",
    "asyncckpt.lightning",
    "asyncckpt.transformers",
    "asyncckpt.cli.main",
    "asyncckpt.cli.formats",
    "asyncckpt.cli.verify",
    "asyncckpt._storage.local",
    "asyncckpt._storage.s3",
}


def test_only_the_entry_points_resolve_the_settings() -> None:
    """Below the entry points the settings are passed down, never resolved again: a
    fallback (``settings or Settings.resolve()``) reads the environment where the caller
    gave its own tunables, and silently drops them when a caller forgets to pass them on
    (docs/ARCHITECTURE.md, "Settings"). Docstring examples are text, not counted."""
    found = [
        f"{path}:{node.lineno}: Settings.{node.attr}"
        for module, path in MODULES.items()
        if module not in SETTINGS_ENTRY_POINTS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in ("resolve", "of")
        and isinstance(node.value, ast.Name)
        and node.value.id == "Settings"
    ]
    assert not found, found
