"""What a crafted file can make a reader do: names, sizes and memory, bounded before use.

Files are built with the pure functions of ``asyncckpt.format`` (and DCP metadata by hand),
so each test says exactly what is crafted.
"""

from __future__ import annotations

from asyncckpt.sharded_load import _RANK_FILE


def test_rank_file_names_take_ascii_digits_only() -> None:
    """``\\d`` would accept other scripts' digits, which ``int()`` turns into a rank."""
    tail = "-" + "0" * 32 + ".ackpt"
    assert _RANK_FILE.fullmatch("r00001" + tail)
    assert not _RANK_FILE.fullmatch("r\u0660\u0660\u0660\u0660\u0661" + tail)
    assert not _RANK_FILE.fullmatch("r00001" + tail + "\n")
