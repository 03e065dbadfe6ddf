"""Each of "storage", "version", "writer" and "marker" names one thing (docs/ARCHITECTURE.md,
"Words"): the names the other things had must not come back, in the package or its docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What each retired name is called now.
RETIRED = {
    r"\b(completion|progress|failure|commit|FAILED|rank's|ranks'|rank) markers?\b": (
        "a commit, failure, completion or progress *record*: 'marker' is the drop-in save marker"
    ),
    r"\bRankMarker\b": "RankDone",
    r"\bmarker_name\b": "record_name",
    r"\bawait_markers\b": "await_ranks",
    r"\bstorage\s*=\s*\S*untyped_storage\(": "memory = t.untyped_storage()",
}


def _texts() -> list[Path]:
    package = sorted((ROOT / "asyncckpt").rglob("*.py"))
    return package + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("pattern", sorted(RETIRED))
def test_a_retired_name_does_not_come_back(pattern: str) -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
        for path in _texts()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(pattern, line, re.IGNORECASE if "marker" in pattern.lower() else 0)
    ]
    assert not found, f"say {RETIRED[pattern]!r} instead:\n" + "\n".join(found)
