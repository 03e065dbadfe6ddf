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
    return module in ("tests", "conftest") or module.startswith("tests.")


@cache
def _names_in(function: Any) -> frozenset[str] | None:
    """Every name and attribute the source of ``function`` mentions (None: no source)."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return frozenset(names)
