"""The file format's parsers fuzzed: a data file's manifest (and the whole file), and DCP
metadata.

Manifests are a real file's, with fields replaced by arbitrary JSON and re-sealed (right
length and checksum, so the validator and the decoder behind it are what is tested); whole
files are cut and spliced; DCP metadata is a real ``asyncckpt.dcp.Writer`` directory's,
mutated the same way. Only asyncckpt errors may escape, under an address-space limit
(``tests/fuzzing.py``).
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

import asyncckpt
from asyncckpt._convert.consolidate import ShardedSource
from asyncckpt._format.container import FOOTER_SIZE, decode_footer, encode_footer
from asyncckpt._format.index import decode_metadata
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt.dcp import Writer
from tests.fuzzing import FUZZ, memory_limited, mutated_json, only_asyncckpt_errors, record_bytes


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=g)
    return {
        "w": base,
        "t": base.t(),  # a view of the same storage, strided
        "h": torch.randn(40, generator=g).to(torch.bfloat16),
        "i": torch.arange(7, dtype=torch.int32),
        "s": torch.tensor(2.5),
        "meta": {"step": 3, "name": "x", "xs": [1, 2.0, None]},
    }


def _seed_file() -> bytes:
    buf = io.BytesIO()
    asyncckpt.save(_state(), buf, compression="zstd")
    return buf.getvalue()


SEED = _seed_file()
FOOTER = decode_footer(SEED[-FOOTER_SIZE:], len(SEED), "seed")
MANIFEST = json.loads(
    SEED[FOOTER.manifest_offset : FOOTER.manifest_offset + FOOTER.manifest_length]
)


def _sealed(manifest: Any) -> bytes:
    """The seed file with ``manifest`` in place of its own, length and checksum right."""
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    offset = FOOTER.manifest_offset
    return SEED[:offset] + raw + encode_footer(offset, raw)


def _load(data: bytes) -> None:
    with memory_limited():
        only_asyncckpt_errors(lambda: asyncckpt.load(io.BytesIO(data)))


def test_the_seed_loads() -> None:
    """Mutations start from a file the reader accepts, re-sealed the same way."""
    got = asyncckpt.load(io.BytesIO(_sealed(MANIFEST)))
    assert torch.equal(got["t"], _state()["t"]) and got["meta"] == _state()["meta"]


@FUZZ
@given(manifest=mutated_json(MANIFEST, max_changes=4))
def test_manifests(manifest: Any) -> None:
    _load(_sealed(manifest))


@st.composite
def _damaged_files(draw: st.DrawFn) -> bytes:
    data = SEED
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        cut = draw(st.integers(0, 16))
        data = data[:at] + draw(st.binary(max_size=16)) + data[at + cut :]
    return data


@FUZZ
@given(data=_damaged_files())
def test_damaged_files(data: bytes) -> None:
    _load(data)


# -- DCP metadata ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.arange(6.0).reshape(2, 3), "n": 3, "b": torch.ones(2, dtype=torch.bool)},
            storage_writer=Writer(str(directory)),
        )
    return directory


def _metadata_path(directory: Path) -> Path:
    (path,) = directory.glob("*.metadata")
    return path


def _dcp_seed() -> dict[str, Any]:
    # Built once per session from a real Writer directory (see dcp_dir); the strategy
    # needs the document when the test is collected, so it is made here the same way.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(
                {
                    "w": torch.arange(6.0).reshape(2, 3),
                    "n": 3,
                    "b": torch.ones(2, dtype=torch.bool),
                },
                storage_writer=Writer(tmp),
            )
        doc: dict[str, Any] = json.loads(_metadata_path(Path(tmp)).read_bytes())
    return doc


DCP_SEED = _dcp_seed()


@FUZZ
@given(raw=record_bytes(DCP_SEED))
def test_dcp_metadata(dcp_dir: Path, raw: bytes) -> None:
    path = _metadata_path(dcp_dir)
    good = path.read_bytes()
    path.write_bytes(raw)
    try:
        with memory_limited():
            only_asyncckpt_errors(lambda: decode_metadata(raw, "fuzzed.metadata"))
            source = only_asyncckpt_errors(
                lambda: ShardedSource.open(*resolve(str(dcp_dir), None), None, Settings())
            )
            if source is not None:
                source.close()
    finally:
        path.write_bytes(good)


def test_the_dcp_seed_decodes(dcp_dir: Path) -> None:
    assert decode_metadata(json.dumps(DCP_SEED).encode(), "seed").state_dict_metadata
    ShardedSource.open(*resolve(str(dcp_dir), None), None, Settings()).close()
