"""Marks every test by what it needs, at collection, so that nobody has to remember to.

- ``procs``: starts processes (subprocesses, gloo ranks, forks, ``torchrun``), found by
  reading the test, its fixtures and the test helpers they call (``tests.*`` functions,
  followed transitively) for the names that start one;
- ``s3``: uses an S3 server (``s3_server``, ``moto``, ``seaweed``, or a fixture built on them);
- ``docs``: runs a documentation block in a fresh interpreter;
- ``bench``: runs a benchmark (``tests/benchmarks``).

``make quick`` runs what has none of these: the in-process tests, in parallel.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

#: The marks this module applies (registered in ``pyproject.toml``).
AUTO_MARKS = ("procs", "s3", "docs", "bench")

#: Names whose use starts a process (modules, functions, attributes).
_PROCESS_NAMES = frozenset(
    {
        "subprocess",
        "Popen",
        "check_call",
        "check_output",
        "multiprocessing",
        "get_context",
        "Process",
        "fork",
        "forkpty",
        "posix_spawn",
        "executable",  # sys.executable: a fresh interpreter
        "run_ranks",
        "torchrun",
        # signals to a process (this test's child, or the library's writer process)
        "kill",
        "killpg",
        "SIGKILL",
        "SIGTERM",
        # the library's writer process, driven on purpose
        "WriterProcess",
        "writer_process",
        # test servers in processes of their own
        "MotoServer",
        "SeaweedServer",
        "FaultProxy",
    }
)
#: Modules a test may call into that start processes for it.
_PROCESS_MODULES = frozenset(
    {"subprocess", "multiprocessing", "torch.multiprocessing", "tests.ranks"}
)
_S3_FIXTURES = frozenset({"s3_server", "s3_store", "moto", "seaweed"})
#: Test kits read as libraries, not followed: ``tests.crashpoints`` kills its own process
#: only in its ``"kill"`` mode, which a test uses by running the scenario in a child it
#: starts itself (and is marked for); its other modes run in the test's process.
_NOT_FOLLOWED = frozenset({"tests.crashpoints"})


def apply(items: list[pytest.Item]) -> None:
    """Add the automatic marks to ``items``, and put the tests that start processes first:
    parallel workers then end together instead of waiting on one long test at the end."""
    heavy = set()
    for item in items:
        for mark in marks_of(item):
            item.add_marker(mark)
            heavy.add(item)
    items.sort(key=lambda item: item not in heavy)  # stable: file order otherwise kept


def marks_of(item: pytest.Item) -> list[str]:
    """The automatic marks ``item`` needs."""
    path = item.path.as_posix()
    fixtures = set(getattr(item, "fixturenames", ()))
    found = []
    if _S3_FIXTURES & fixtures:
        found.append("s3")
    if "/tests/benchmarks/" in path:
        found.append("bench")
    if path.endswith("/tests/test_docs.py") and "python_block" in item.name:
        found.append("docs")
    if found or _starts_processes(item):
        found.append("procs")
    return found


def _starts_processes(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    if function is None:  # a doctest: what its examples name
        test = getattr(item, "dtest", None)
        source = "".join(e.source for e in getattr(test, "examples", ()))
        return any(name in source for name in _PROCESS_NAMES)
    if _calls_process(function):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info is not None else ():
        if any(_calls_process(d.func) for d in defs):
            return True
    return False


def _calls_process(function: Callable[..., Any]) -> bool:
    return _reaches_process(inspect.unwrap(function), frozenset())


def _reaches_process(helper: Any, seen: frozenset[Any]) -> bool:
    """Whether a function or class of the tests names a process, itself or through the
    test helpers it names."""
    if helper in seen:
        return False
    names = _names_in(helper)
    if names is None:
        return False
    if names & _PROCESS_NAMES:
        return True
    scope = vars(sys.modules.get(helper.__module__, types.ModuleType("absent")))
    for name in names:
        value = scope.get(name)
        if isinstance(value, types.ModuleType) and value.__name__ in _PROCESS_MODULES:
            return True
        if _is_test_helper(value) and _reaches_process(value, seen | {helper}):
            return True
    return False


def _is_test_helper(value: Any) -> bool:
    """A function or class of the test suite (followed), not of a library."""
    if not (inspect.isfunction(value) or inspect.isclass(value)):
        return False
    module = getattr(value, "__module__", "") or ""
    if module in _NOT_FOLLOWED:
        return False
    return module in ("tests", "conftest") or module.startswith("tests.")


@cache
def _names_in(function: Any) -> frozenset[str] | None:
    """Every name and attribute the source of ``function`` mentions (None: no source)."""
    tree = _definition_of(function)
    if tree is None:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError, SyntaxError):
            return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return frozenset(names)


def _definition_of(helper: Any) -> ast.AST | None:
    """The ``def`` or ``class`` statement of a helper, from its file parsed once:
    ``inspect.getsource`` tokenizes or parses the file again for each one, which made
    collection seconds longer on each worker."""
    code = getattr(helper, "__code__", None)
    if code is not None:
        return _definitions_in(code.co_filename).get(code.co_firstlineno)
    module = sys.modules.get(getattr(helper, "__module__", None) or "")
    filename = getattr(module, "__file__", None)
    if not inspect.isclass(helper) or filename is None:
        return None
    return _definitions_in(filename).get(helper.__qualname__)


@cache
def _definitions_in(filename: str) -> dict[int | str, ast.AST]:
    """The definitions in a file: functions by their first line (their first decorator's,
    as ``co_firstlineno``), classes by their qualified name."""
    try:
        tree = ast.parse(Path(filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[int | str, ast.AST] = {}

    def visit(statements: list[Any], prefix: str) -> None:
        # Definitions are statements: only the blocks of statements are walked.
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                found[first] = node
                visit(node.body, f"{prefix}{node.name}.<locals>.")
            elif isinstance(node, ast.ClassDef):
                found.setdefault(prefix + node.name, node)
                visit(node.body, f"{prefix}{node.name}.")
            else:
                for block in ("body", "orelse", "finalbody", "handlers", "cases"):
                    visit(getattr(node, block, []), prefix)

    visit(tree.body, "")
    return found
