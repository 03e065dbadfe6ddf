"""The fuzzers' own promise: in ``make test`` they draw the same examples on every run."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

from tests.fuzzing import DEEP_EXAMPLES, FUZZ, JSON_VALUES


def _examples() -> list[Any]:
    drawn: list[Any] = []

    @FUZZ
    @given(JSON_VALUES)
    def collect(value: Any) -> None:
        drawn.append(value)

    collect()
    return drawn


@pytest.mark.skipif(bool(DEEP_EXAMPLES), reason="FUZZ_EXAMPLES: new examples on purpose")
def test_the_fuzzers_draw_the_same_examples_whatever_was_imported_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hypothesis also draws literals it finds in the project's imported modules, and which
    # modules a pytest worker imported depends on the tests it ran before.
    before = _examples()
    words = ", ".join(repr(f"literal-{i}") for i in range(300))
    numbers = ", ".join(str(7_000_000 + i) for i in range(300))
    (tmp_path / "fuzz_literals.py").write_text(f"WORDS = [{words}]\nNUMBERS = [{numbers}]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("fuzz_literals")
    assert _examples() == before
