"""The names of the files in a version's directory: one definition each. Pure: no I/O."""

from __future__ import annotations

import re
from typing import Final

#: Name of the commit object inside a checkpoint directory (or prefix). It is DCP's own
#: name, so tools that recognise a finished DCP checkpoint by the presence of
#: ``<dir>/.metadata`` (torchtitan's resume-step scan, retention scripts) see these too;
#: the content is JSON, and a pickle found there is refused (:func:`decode_metadata`).
METADATA_NAME: Final = ".metadata"
#: The suffix of a sharded version's JSON index of its pieces (this module's schema),
#: named ``r<writer rank>-<attempt>.metadata`` by :func:`metadata_file_name`.
METADATA_SUFFIX: Final = ".metadata"
#: ``r<rank>-<token>.ackpt``: the rank keeps ranks apart, the token (a writer's 12 hex
#: digits, or a save attempt's 32) keeps two saves into one directory apart. A name from a
#: file is matched against this before it is joined to a path, so a crafted commit object
#: cannot point outside its directory. ASCII digits only: no other script's digits alias a
#: rank.
_DATA_NAME: Final = re.compile(r"r([0-9]{5,9})-(?:[0-9a-f]{12}|[0-9a-f]{32})\.ackpt")
_METADATA_FILE: Final = re.compile(r"r[0-9]{5,9}-[0-9a-f]{32}\.metadata")


def data_file_name(rank: int, token: str) -> str:
    """The name of ``rank``'s data file, unique to one writer (``token``: 12 hex digits) or
    one save attempt (32 hex digits), in plain and sharded versions and ``asyncckpt.dcp``.

    Raises:
        ValueError: ``rank`` or ``token`` would give a name :func:`is_data_file_name` refuses.

    Example:
        >>> data_file_name(3, "ab" * 16), data_file_name(0, "0123456789ab")
        ('r00003-abababababababababababababababab.ackpt', 'r00000-0123456789ab.ackpt')
    """
    name = f"r{rank:05d}-{token}.ackpt"
    if not _DATA_NAME.fullmatch(name):
        raise ValueError(f"invalid rank {rank} or attempt token {token!r}")
    return name


def rank_of_data_file(name: str) -> int | None:
    """The rank whose data file ``name`` is, or None if it is not a data file name.

    Example:
        >>> rank_of_data_file("r00001-" + "0" * 32 + ".ackpt"), rank_of_data_file("r1.ackpt")
        (1, None)
    """
    match = _DATA_NAME.fullmatch(name)
    return None if match is None else int(match.group(1))


def metadata_file_name(rank: int, attempt: str) -> str:
    """Name of a sharded version's metadata, written by the writer rank ``rank`` in save
    attempt ``attempt``: no other attempt, of this writer or another, can have that name.

    Example:
        >>> metadata_file_name(0, "ab" * 16)
        'r00000-abababababababababababababababab.metadata'
    """
    return f"r{rank:05d}-{attempt}{METADATA_SUFFIX}"


def is_metadata_name(name: str) -> bool:
    """Whether ``name`` is a sharded version's metadata: attempt-named, or the fixed
    :data:`METADATA_NAME` (``asyncckpt.dcp``'s commit object, and the index of sharded
    versions written by older asyncckpt versions).

    Example:
        >>> [is_metadata_name(n) for n in (".metadata", metadata_file_name(1, "0" * 32), "x")]
        [True, True, False]
    """
    return name == METADATA_NAME or _METADATA_FILE.fullmatch(name) is not None


def is_data_file_name(name: str) -> bool:
    """Whether ``name`` is a data file name this module writes.

    Example:
        >>> is_data_file_name("r00000-" + "0" * 32 + ".ackpt"), is_data_file_name("../x")
        (True, False)
    """
    return _DATA_NAME.fullmatch(name) is not None
