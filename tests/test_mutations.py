"""``scripts/mutations.py`` stays able to run: each mutation's edit still matches the code it
breaks (exactly once) and names tests that exist. A refactor that moves the text would
otherwise leave a guarantee unchecked until someone runs the script by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _mutations() -> Any:
    spec = importlib.util.spec_from_file_location("mutations", REPO / "scripts" / "mutations.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutations", module)
    spec.loader.exec_module(module)
    return module


MUTATIONS = _mutations().MUTATIONS


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_still_applies_once_and_names_real_tests(mutation: Any) -> None:
    source = (REPO / mutation.file).read_text(encoding="utf-8")
    assert source.count(mutation.old) == 1, f"{mutation.name}: the edit no longer matches"
    assert mutation.old != mutation.new
    for test in mutation.tests:
        path, _, name = test.partition("::")
        text = (REPO / path).read_text(encoding="utf-8")
        assert not name or f"def {name.split('[')[0]}(" in text, f"{mutation.name}: {test}"
